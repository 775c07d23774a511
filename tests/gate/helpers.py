"""Helpers for gate tests: a real gate subprocess in front of a real schedule server."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import aiohttp

from tierguard.common.proc import ReadyProcess


class GateProcess:
    """`tierguard gate` as a subprocess on an ephemeral port; a context manager."""

    def __init__(self, upstream: str, *flags: str, jobs_dir: str | Path, log: str | Path | None = None) -> None:
        args = [sys.executable, "-m", "tierguard.cli.main", "gate", "--upstream", upstream, "--port", "0",
                "--jobs-dir", str(jobs_dir), *flags]
        if log is not None:
            args += ["--log", str(log)]
        self.args = args
        self.stderr_path = Path(jobs_dir).parent / f"gate-{time.monotonic_ns()}.err"
        self._child = ReadyProcess(args, "READY ", stderr_path=self.stderr_path, grace_s=5.0)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def proc(self):
        return self._child.proc

    def start(self, timeout_s: float = 20.0) -> GateProcess:
        self.port = int(self._child.start(timeout_s).split()[0])
        return self

    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the crash case; nothing gets a chance to clean up."""
        self._child.kill()

    def stop(self) -> None:
        self._child.stop()

    def __enter__(self) -> GateProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


async def get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with session.get(url) as r:
        return r.status, await r.json(content_type=None)


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict,
                         headers: dict | None = None) -> dict:
    """One request; returns status, headers, ttft (s), e2e (s), number of chunks."""
    t0 = time.monotonic()
    out: dict = {"ttft": None, "chunks": 0}
    async with session.post(url, json=body, headers=headers) as r:
        out["status"], out["headers"] = r.status, dict(r.headers)
        if r.status != 200 or not body.get("stream"):
            out["body"] = await r.json(content_type=None)
        else:
            async for _ in r.content.iter_any():
                if out["ttft"] is None:
                    out["ttft"] = time.monotonic() - t0
                out["chunks"] += 1
    out["e2e"] = time.monotonic() - t0
    return out


def run(coro):
    return asyncio.run(coro)


def schedule_server_on(port: int, **schedule) -> ReadyProcess:
    """A schedule server on a given port (to bring a killed upstream back where it was)."""
    args = [sys.executable, "-m", "tierguard.bench.schedule_server", "--port", str(port)]
    for k, v in schedule.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    child = ReadyProcess(args, "READY ", grace_s=5.0)
    child.start(20.0)
    return child


async def metric(session: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`, on a /metrics page; 0 when absent."""
    from tierguard.bench.scrape import parse_metrics

    async with session.get(url + "/metrics") as r:
        samples = parse_metrics(await r.text())
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items()
               if (k == name or k.startswith(name + "{")) and all(w in k for w in want))
