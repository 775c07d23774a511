"""An OpenAI-compatible streaming server whose TTFT is a known function of the prompts.

It runs one engine loop as an engine with chunked prefill does: each step takes one row
per running decode, then prefill chunks in arrival order up to `chunk` tokens, and lasts
`per_step + per_token x prefill tokens + per_decode x decodes` milliseconds (absolute
deadlines: a late wake-up does not push later steps). A request's first token leaves
at the end of the step that finishes its prompt, every later one a step later. A prompt's
tokens are its whitespace-separated words (its /tokenize counts them the same way), so
a client knows exactly what it sends. `/truth` lists what the server did per request:
its first word (an id the client chose), its tokens, when it arrived, when its prefill
began and when its first token left (CLOCK_MONOTONIC, as the client's clock).

    python -m tests.gate.cost_server --port 0 --per-token-ms 0.25 --per-step-ms 4 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from aiohttp import web

from tierguard.common.proc import ReadyProcess


@dataclass
class Costs:
    per_token_ms: float = 0.25
    per_step_ms: float = 4.0
    per_decode_ms: float = 0.5
    chunk: int = 512


@dataclass(eq=False)
class _Req:
    rid: str
    tokens: int
    out_left: int
    arrival: float
    left: int = 0
    started: float | None = None
    first: float | None = None
    gone: bool = False
    out: asyncio.Queue = field(default_factory=asyncio.Queue)

    def truth(self) -> dict:
        return {"id": self.rid, "tokens": self.tokens, "arrival": self.arrival, "started": self.started,
                "first": self.first}


def words(body: dict) -> tuple[str, int]:
    text = body.get("prompt")
    if not isinstance(text, str):
        text = " ".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
    parts = text.split()
    return (parts[0] if parts else ""), len(parts)


class Engine:
    def __init__(self, costs: Costs) -> None:
        self.c = costs
        self.prefilling: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.records: list[_Req] = []
        self.wake = asyncio.Event()

    def add(self, r: _Req) -> None:
        r.left = r.tokens
        self.prefilling.append(r)
        self.records.append(r)
        self.wake.set()

    async def run(self) -> None:
        t = time.monotonic()
        while True:
            self.prefilling = deque(r for r in self.prefilling if not r.gone)
            self.running = [r for r in self.running if not r.gone]
            if not self.prefilling and not self.running:
                self.wake.clear()
                await self.wake.wait()
                t = time.monotonic()
            budget = self.c.chunk
            decodes = self.running[:budget]
            budget -= len(decodes)
            tokens, done = 0, []
            for r in self.prefilling:
                if budget <= 0:
                    break
                take = min(budget, r.left)
                r.left, budget, tokens = r.left - take, budget - take, tokens + take
                if r.started is None:
                    r.started = t
                if r.left == 0:
                    done.append(r)
            end = t + (self.c.per_step_ms + self.c.per_token_ms * tokens + self.c.per_decode_ms * len(decodes)) / 1000
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            for r in decodes:
                r.out_left -= 1
                r.out.put_nowait(r.out_left == 0)
            self.running = [r for r in self.running if r.out_left > 0]
            for r in done:
                self.prefilling.remove(r)
                r.first = time.monotonic()
                r.out_left -= 1
                r.out.put_nowait(r.out_left == 0)
                if r.out_left > 0:
                    self.running.append(r)
            t = end


def create_app(costs: Costs) -> web.Application:
    engine = Engine(costs)
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def complete(request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        body = await request.json()
        rid, n = words(body)
        r = _Req(rid, max(1, n), max(1, int(body.get("max_tokens") or 8)), arrived)
        engine.add(r)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            last = False
            while not last:
                last = await r.out.get()
                if not resp.prepared:
                    await resp.prepare(request)
                chunk = {"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": " tok"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            r.gone = True
        return resp

    async def tokenize(request: web.Request) -> web.Response:
        _, n = words(await request.json())
        return web.json_response({"count": n, "tokens": list(range(n)), "max_model_len": 1 << 20})

    async def truth(_: web.Request) -> web.Response:
        return web.json_response({"requests": [r.truth() for r in engine.records]})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "cost", "object": "model",
                                                                "max_model_len": 1 << 20}]})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def start(app: web.Application) -> None:
        app["engine_task"] = asyncio.create_task(engine.run())

    app.on_startup.append(start)
    for path in ("/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, complete)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/truth", truth)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


async def _serve(port: int, costs: Costs) -> None:
    runner = web.AppRunner(create_app(costs), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"READY {site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


class CostServer:
    """The server as a subprocess; a context manager."""

    def __init__(self, costs: Costs) -> None:
        self.costs = costs
        args = [sys.executable, "-m", "tests.gate.cost_server", "--port", "0"]
        for name in ("per_token_ms", "per_step_ms", "per_decode_ms", "chunk"):
            args += ["--" + name.replace("_", "-"), str(getattr(costs, name))]
        self._child = ReadyProcess(args, "READY ", grace_s=5.0)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> CostServer:
        self.port = int(self._child.start(20.0).split()[0])
        return self

    def __exit__(self, *exc) -> None:
        self._child.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--per-token-ms", type=float, default=Costs.per_token_ms)
    p.add_argument("--per-step-ms", type=float, default=Costs.per_step_ms)
    p.add_argument("--per-decode-ms", type=float, default=Costs.per_decode_ms)
    p.add_argument("--chunk", type=int, default=Costs.chunk)
    a = p.parse_args()
    asyncio.run(_serve(a.port, Costs(a.per_token_ms, a.per_step_ms, a.per_decode_ms, a.chunk)))
