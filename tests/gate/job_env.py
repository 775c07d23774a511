"""An in-process gate in front of an upstream the test controls, and a disk that can be filled.

`HeldUpstream` answers /v1/completions only when the test lets it (`release`), so async jobs
stay pending, or sit in a known state, for as long as a test needs: no sleeps, no timing.
`TinyDisk` is a real 1 MiB tmpfs when the test runs as root (`fill` writes a file until the
kernel says ENOSPC); elsewhere the jobs' write helper raises ENOSPC while it is "full".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import subprocess
from pathlib import Path

import aiohttp
from aiohttp import web

from tierguard.common.peer_conn import guarded_runner
from tierguard.gate.app import GUARD, build_app
from tierguard.gate.policy import GateSettings


class HeldUpstream:
    def __init__(self) -> None:
        self.arrived = 0
        self.gate = asyncio.Event()  # set: answer every request
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def complete(self, request: web.Request) -> web.Response:
        await request.read()
        self.arrived += 1
        await self.gate.wait()
        return web.json_response({"object": "text_completion", "choices": [{"index": 0, "text": "ok"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def start(self) -> HeldUpstream:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    def release(self) -> None:
        self.gate.set()

    async def until_arrived(self, n: int) -> None:
        while self.arrived < n:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.release()
        if self.runner is not None:
            await self.runner.cleanup()


@contextlib.asynccontextmanager
async def gate_in_process(upstream_url: str, jobs_dir: Path, **settings):
    """(gate app, base URL, client session) for a gate with `settings` (GateSettings fields)."""
    s = GateSettings(upstream=upstream_url, jobs_dir=str(jobs_dir), health_interval_s=60, **settings).validate()
    app = build_app(s)
    runner = guarded_runner(app[GUARD], app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield app, f"http://127.0.0.1:{runner.addresses[0][1]}", session
    finally:
        await runner.cleanup()


async def post(session: aiohttp.ClientSession, url: str, body: dict, key: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


async def job(session: aiohttp.ClientSession, base: str, job_id: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.get(f"{base}/v1/async/{job_id}", headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def until_done(session: aiohttp.ClientSession, base: str, job_id: str, key: str | None = None,
                     app: web.Application | None = None) -> dict:
    """The job once it ended; with `app`, an AssertionError as soon as no async worker is left
    to end it (instead of waiting forever)."""
    while True:
        j = await job(session, base, job_id, key)
        if j["status"] in ("succeeded", "failed"):
            return j
        if app is not None:
            assert live_workers(app) > 0, f"every async worker died; job {job_id} stays {j['status']}"
        await asyncio.sleep(0.02)


def live_workers(app: web.Application) -> int:
    from tierguard.gate.state import GATE

    return sum(not t.done() for t in app[GATE].runner._tasks)


class TinyDisk:
    """A directory on a 1 MiB filesystem that `fill()` makes full and `free()` empties again."""

    def __init__(self, root: Path, monkeypatch) -> None:
        self.dir = root / "tiny"
        self.dir.mkdir()
        self.real = os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(self.dir)],
            capture_output=True).returncode == 0
        self.full = False
        if not self.real:  # not root: the one write helper every job file goes through says ENOSPC
            import tierguard.gate.jobs as jobs

            original = jobs.write_all

            def write_all(fd: int, data) -> None:
                if self.full:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                original(fd, data)

            monkeypatch.setattr(jobs, "write_all", write_all)

    def fill(self) -> None:
        self.full = True
        if self.real:
            fd = os.open(self.dir / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                for size in (65536, 512, 1):  # then the last partial pages
                    with contextlib.suppress(OSError):
                        while True:
                            os.write(fd, b"\0" * size)
            finally:
                os.close(fd)

    def free(self) -> None:
        self.full = False
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "filler").unlink()

    def close(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.dir)], capture_output=True)
