"""An OpenAI-compatible streaming server with a KNOWN token schedule.

Why: a load generator can only be trusted if it reads back a schedule whose truth is
known. This server emits the first token `ttft_ms` after a request arrives and every
later token `itl_ms` after the previous one, optionally packs `tokens_per_chunk`
tokens into one SSE chunk, injects a stall of `stall_ms` into every `stall_every`-th
request, and can imitate the quirks of real engines (no `[DONE]`, no usage, 422 on
unknown fields such as `ignore_eos`). Emission times are absolute deadlines from the
arrival time, so sleep jitter never accumulates.

`capacity` bounds how many streams it serves at once (extra requests wait inside, like
an engine's queue) — the upstream of admission-control tests.

Run as a real process: `python -m tierguard.bench.schedule_server --port 0 ...`; it
prints `READY <port>` on stdout once listening. `ScheduleServer` starts and stops one.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields

from aiohttp import web

from tierguard.common.proc import ReadyProcess
from tierguard.serve.responses import usage

KNOWN_FIELDS = {
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
    "stream_options", "temperature", "top_p", "seed", "stop", "n", "user",
}


@dataclass
class Schedule:
    ttft_ms: float = 50.0
    itl_ms: float = 20.0
    output_tokens: int | None = None  # None: honour max_tokens (default 16)
    tokens_per_chunk: int = 1
    stall_every: int = 0  # 0: never; N: requests N, 2N, ... stall once
    stall_ms: float = 0.0
    stall_at_token: int = 10  # the gap BEFORE this token index is stretched
    capacity: int = 0  # 0: unlimited concurrent streams
    send_done: bool = True
    send_usage: bool = True
    reject_unknown_fields: bool = False  # answer 422 like strict servers do
    model: str = "schedule-model"

    def token_times(self, n_tokens: int, stalled: bool) -> list[float]:
        """Offsets in seconds from arrival (after the capacity wait) of each token."""
        times, t = [], self.ttft_ms / 1000.0
        for i in range(n_tokens):
            if i > 0:
                t += self.itl_ms / 1000.0
                if stalled and i == self.stall_at_token:
                    t += self.stall_ms / 1000.0
            times.append(t)
        return times


def _error(status: int, message: str, etype: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": etype, "code": status}}
    return web.json_response(body, status=status)


class _Handler:
    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule
        self.counter = itertools.count(1)
        self.sem = asyncio.Semaphore(schedule.capacity) if schedule.capacity else None
        self.active = 0
        self.max_active = 0
        self.truth: list[dict] = []  # per streamed request: what the server actually did
        self.requests_total = 0
        self.tokenize_total = 0  # /tokenize calls (a gate's token-count round trips)
        self.waiting = 0  # requests queued for capacity

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.s.model, "object": "model"}]})

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "active": self.active, "max_active": self.max_active})

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "schedule-server-1", "schedule": asdict(self.s)})

    async def truth_view(self, request: web.Request) -> web.Response:
        """Ground truth for clients under test: arrival, start and the CLOCK_MONOTONIC time
        of every write with its token count (same clock as any local client process)."""
        rows = self.truth
        if request.query.get("reset"):
            self.truth = []
        return web.json_response({"requests": rows})

    async def metrics(self, _: web.Request) -> web.Response:
        text = (
            "# TYPE schedule_active_streams gauge\n"
            f"schedule_active_streams {self.active}\n"
            "# TYPE schedule_requests_waiting gauge\n"
            f"schedule_requests_waiting {self.waiting}\n"
            "# TYPE schedule_requests counter\n"
            f"schedule_requests_total {self.requests_total}\n"
            "# TYPE schedule_tokenize_requests counter\n"
            f"schedule_tokenize_requests_total {self.tokenize_total}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def tokenize(self, request: web.Request) -> web.Response:
        self.tokenize_total += 1
        body = await request.json()
        text = body.get("prompt") or " ".join(m.get("content", "") for m in body.get("messages", []))
        tokens = list(range(len(text.split())))  # one token per whitespace-separated word
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "malformed JSON body")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        unknown = sorted(set(body) - KNOWN_FIELDS)
        if self.s.reject_unknown_fields and unknown:
            return _error(422, f"unknown fields: {', '.join(unknown)}")
        chat = request.path.endswith("/chat/completions")
        n_tokens = self.s.output_tokens or int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        idx = next(self.counter)
        self.requests_total += 1
        stalled = bool(self.s.stall_every) and idx % self.s.stall_every == 0
        prompt = body.get("prompt") if not chat else json.dumps(body.get("messages", []))
        n_prompt = len(str(prompt or "").split())
        if self.sem is not None:
            self.waiting += 1
            try:
                await self.sem.acquire()
            finally:
                self.waiting -= 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            start = time.monotonic()
            if not body.get("stream"):
                await asyncio.sleep(max(0.0, start + self.s.token_times(n_tokens, stalled)[-1] - time.monotonic()))
                return web.json_response(self._full(chat, n_tokens, n_prompt, idx))
            return await self._stream(request, body, chat, n_tokens, n_prompt, idx, start, stalled, arrived)
        finally:
            self.active -= 1
            if self.sem is not None:
                self.sem.release()

    def _full(self, chat: bool, n: int, n_prompt: int, idx: int) -> dict:
        text = " tok" * n
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": f"req-{idx}", "object": "chat.completion" if chat else "text_completion",
                "model": self.s.model, "choices": [choice], "usage": usage(n_prompt, n)}

    async def _stream(self, request, body, chat, n_tokens, n_prompt, idx, start, stalled, arrived):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        resp.headers["X-Schedule-Stalled"] = "1" if stalled else "0"
        resp.headers["X-Schedule-Queue-Ms"] = f"{(start - arrived) * 1000:.3f}"
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        opts = body.get("stream_options") or {}
        continuous = bool(opts.get("continuous_usage_stats")) and self.s.send_usage
        include_usage = bool(opts.get("include_usage")) and self.s.send_usage
        times = self.s.token_times(n_tokens, stalled)
        k = max(1, self.s.tokens_per_chunk)
        obj = "chat.completion.chunk" if chat else "text_completion"
        # Chunks are formatted from a template (json.dumps per chunk costs the server more
        # CPU than the clients under test spend); tests check they parse as JSON.
        head = f'data: {{"id": "req-{idx}", "object": "{obj}", "model": {json.dumps(self.s.model)}, "choices": [{{"index": 0, '
        record = {"id": f"req-{idx}", "arrival": arrived, "start": start, "stalled": stalled,
                  "times": [], "tokens": []}
        self.truth.append(record)
        # Tokens leave from a chain of loop callbacks writing straight to the transport
        # (chunked framing done here): a coroutine wake-up plus aiohttp's write path per
        # token made the server, not the client under test, the bottleneck at 1k streams.
        loop = asyncio.get_running_loop()
        transport = request.transport
        done: asyncio.Future = loop.create_future()
        state = {"sent": 0}

        def schedule_next() -> None:
            count = min(k, n_tokens - state["sent"])
            due = start + times[state["sent"] + count - 1]  # a chunk leaves when its last token is ready
            loop.call_at(loop.time() + max(0.0, due - time.monotonic()), emit, count)

        def emit(count: int) -> None:
            if done.done():
                return
            if transport is None or transport.is_closing():
                done.set_result(False)
                return
            state["sent"] += count
            sent = state["sent"]
            text = " tok" * count
            finish = '"length"' if sent == n_tokens else "null"
            body = (f'"delta": {{"content": "{text}"}}' if chat else f'"text": "{text}"')
            line = f'{head}"finish_reason": {finish}, {body}}}]'
            if continuous:
                line += (f', "usage": {{"prompt_tokens": {n_prompt}, "completion_tokens": {sent}, '
                         f'"total_tokens": {n_prompt + sent}}}')
            data = (line + "}\n\n").encode()
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            record["times"].append(time.monotonic())
            record["tokens"].append(count)
            if sent < n_tokens:
                schedule_next()
            else:
                done.set_result(True)

        try:
            schedule_next()
            if not await done:
                return resp
            if include_usage:
                final = {"id": f"req-{idx}", "object": obj, "model": self.s.model, "choices": [],
                         "usage": usage(n_prompt, n_tokens)}
                await resp.write(f"data: {json.dumps(final)}\n\n".encode())
            if self.s.send_done:
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass  # the client left; nothing to clean up
        return resp


def create_app(schedule: Schedule) -> web.Application:
    h = _Handler(schedule)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", h.complete)
    app.router.add_post("/v1/chat/completions", h.complete)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/health", h.health)
    app.router.add_get("/version", h.version)
    app.router.add_post("/tokenize", h.tokenize)
    app.router.add_get("/truth", h.truth_view)
    app.router.add_get("/metrics", h.metrics)
    app["handler"] = h
    return app


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, Schedule]:
    p = argparse.ArgumentParser(description="OpenAI-compatible server with a known token schedule")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    for f in fields(Schedule):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",):
            p.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "yes"), default=f.default)
        elif f.name == "output_tokens":
            p.add_argument(flag, type=int, default=None)
        else:
            caster = {"float": float, "int": int, "str": str}[str(f.type)]
            p.add_argument(flag, type=caster, default=f.default)
    ns = p.parse_args(argv)
    return ns, Schedule(**{f.name: getattr(ns, f.name) for f in fields(Schedule)})


async def _serve(host: str, port: int, schedule: Schedule) -> None:
    runner = web.AppRunner(create_app(schedule), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    ns, schedule = _parse(argv)
    try:
        import uvloop  # type: ignore

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(ns.host, ns.port, schedule))


class ScheduleServer:
    """Start the schedule server as a real subprocess; use as a context manager."""

    def __init__(self, schedule: Schedule | None = None, **overrides) -> None:
        s = schedule or Schedule()
        self.schedule = Schedule(**{**asdict(s), **overrides})
        self._child: ReadyProcess | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ScheduleServer:
        args = [sys.executable, "-m", "tierguard.bench.schedule_server", "--port", "0"]
        for k, v in asdict(self.schedule).items():
            if v is not None:
                args += ["--" + k.replace("_", "-"), str(v)]
        self._child = ReadyProcess(args, "READY ", grace_s=5.0)
        self.port = int(self._child.start(timeout_s).split()[0])
        return self

    @property
    def proc(self) -> subprocess.Popen | None:
        return self._child.proc if self._child is not None else None

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()

    def __enter__(self) -> ScheduleServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    main()
