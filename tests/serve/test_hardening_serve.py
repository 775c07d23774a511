"""`tierguard serve` against slow and greedy peers, on real loopback sockets.

The app runs under the guard's runner exactly as the CLI runs it; the engine is the
fake one (fast, counts its KV blocks per request) so each case takes milliseconds, and
the tiny model's real tokenizer where the byte rule is under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from tests.common.test_tokenpool import GatedTokenizer
from tierguard.common.peer_conn import guarded_runner
from tierguard.common.peers import PeerLimits
from tierguard.gate import AdmissionPolicy
from tierguard.serve.app import STATE_KEY, create_app

from .fake_engine import FakeEngine


@contextlib.asynccontextmanager
async def guarded(app: web.Application):
    runner = guarded_runner(app[STATE_KEY].guard, app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or (name.endswith('"') and line.startswith(name)):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from tierguard.model.tiny import ensure_tiny_model
    from tierguard.model.tokenizer import HFTokenizer

    return HFTokenizer(ensure_tiny_model())


def test_header_body_deadlines_and_the_slow_reader():
    engine = FakeEngine(max_model_len=100_000, delay_s=0.0005)
    limits = PeerLimits(header_timeout_s=0.5, body_timeout_s=0.5, slow_reader_bytes=4096)
    app = create_app(engine, limits=limits, admission=AdmissionPolicy(max_concurrency=1, max_queue_wait_ms=50))

    async def main():
        async with guarded(app) as port, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{port}"
            # headers that never end
            r1, w1 = await asyncio.open_connection("127.0.0.1", port)
            w1.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            # a body that never ends
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            w2.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"pro")
            t0 = time.monotonic()
            async with s.get(url + "/health") as r:  # others are served meanwhile
                assert r.status == 200
            header_answer = await asyncio.wait_for(r1.read(), 3)
            header_s = time.monotonic() - t0
            body_answer = await asyncio.wait_for(r2.read(400), 3)
            # a stream whose client does not read: ended, KV and the only slot freed
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            req = json.dumps({"prompt": "go", "stream": True, "max_tokens": 90_000}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(req) + req)
            deadline = time.monotonic() + 10
            while not engine.seen_params and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            while engine.blocks and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            blocks_after = dict(engine.blocks)
            async with s.post(url + "/v1/completions", json={"prompt": "next", "max_tokens": 2}) as r:
                next_status = r.status  # the slot came back: admitted, not 429
            sock.close()
            async with s.get(url + "/metrics") as r:
                return header_answer, header_s, body_answer, blocks_after, next_status, await r.text()

    header_answer, header_s, body_answer, blocks_after, next_status, metrics = asyncio.run(main())
    assert header_answer.startswith(b"HTTP/1.1 408") and b'"code": 408' in header_answer
    assert 0.4 < header_s < 2.0
    assert body_answer.startswith(b"HTTP/1.1 408") and b"not received within 0.5 s" in body_answer
    assert blocks_after == {} and next_status == 200
    for name, value in (("header_timeouts", 1), ("body_timeouts", 1), ("slow_readers", 1)):
        assert _metric(metrics, f"tierguard:http_{name}_total") == value, name
    assert _metric(metrics, 'vllm:request_success_total{finished_reason="abort"') == 1


def test_what_cannot_fit_is_refused_before_any_tokenizer_runs(tiny_tokenizer):
    engine = FakeEngine(max_model_len=256)
    engine.tokenizer = tiny_tokenizer  # the real byte-level tokenizer: L = 17 bytes
    app = create_app(engine)
    state = app[STATE_KEY]
    assert state.token_bytes.max_bytes == 17 and state.max_body_bytes == 256 * (6 * 17 + 64) + 65536

    async def main():
        async with guarded(app) as port, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{port}"
            out = {}
            for name, path, body in (
                ("prompt", "/v1/completions", {"prompt": "x" * (256 * 17)}),
                ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "\u00e9" * (128 * 17)}]}),
                ("tokenize", "/tokenize", {"prompt": "z" * (256 * 17)}),
            ):
                async with s.post(url + path, json=body) as r:
                    out[name] = (r.status, (await r.json())["error"]["message"])
            untouched = (state.pool.stats.submitted, state.pool.stats.inline)
            # over the body limit: 413 from Content-Length (never read), and from a chunked upload
            big = b'{"prompt": "' + b"y" * state.max_body_bytes + b'"}'
            async with s.post(url + "/v1/completions", data=big) as r:
                out["length"] = r.status

            async def chunks():
                for i in range(0, len(big), 1 << 16):
                    yield big[i:i + (1 << 16)]

            async with s.post(url + "/v1/completions", data=chunks()) as r:
                out["chunked"] = r.status
            async with s.post(url + "/v1/completions", json={"prompt": "the cold contract says what goes to disk " * 8, "max_tokens": 2}) as r:
                out["fits"] = r.status
            return out, untouched, state.pool.stats.submitted

    out, untouched, submitted = asyncio.run(main())
    for name in ("prompt", "chat", "tokenize"):
        assert out[name][0] == 400 and "refused before tokenizing" in out[name][1], (name, out[name])
    assert untouched == (0, 0)  # no tokenizer ran on any of them
    assert out["length"] == 413 and out["chunked"] == 413
    assert out["fits"] == 200 and submitted == 1  # a real prompt goes to the worker pool


def test_a_full_tokenizer_queue_is_503_and_health_never_waits():
    engine = FakeEngine(max_model_len=10_000)
    engine.tokenizer = GatedTokenizer()  # long texts block until released
    app = create_app(engine, tokenizer_workers=1, tokenizer_queue=1)

    async def main():
        async with guarded(app) as port, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{port}"
            body = {"prompt": "w" * 500, "max_tokens": 1}
            first = asyncio.create_task(s.post(url + "/v1/completions", json=body))
            await asyncio.sleep(0.1)
            async with s.post(url + "/v1/completions", json=body) as r:
                busy = (r.status, r.headers.get("Retry-After"), (await r.json())["error"]["message"])
            t = time.monotonic()
            async with s.get(url + "/health") as r:
                health = (r.status, time.monotonic() - t)
            engine.tokenizer.gate.set()
            async with await first as r:
                return busy, health, r.status

    busy, health, first = asyncio.run(main())
    assert busy[0] == 503 and busy[1] == "1" and "queue is full" in busy[2]
    assert health[0] == 200 and health[1] < 1.0
    assert first == 200
