"""End to end: a real `tierguard serve` subprocess with the tiny model on a loopback port.

The server is started once per module (`--port 0`, port read from its ready line) and
stopped with SIGTERM at the end, which also tests the graceful shutdown.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import aiohttp
import pytest

from tierguard.cli.serve import READY_PREFIX as READY
from tierguard.common.proc import ReadyProcess

# A few seconds in all: kept in the default run (the openai client test is a must-show).

API_KEY = "test-key"


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cmd = [
        sys.executable,
        "-m",
        "tierguard",
        "serve",
        "--model",
        "tiny",
        "--port",
        "0",
        "--api-key",
        API_KEY,
        "--max-model-len",
        "1024",
        "--kv-cache-gib",
        "0.05",
    ]
    # stderr to a file: a pipe nobody drains could fill up and stall the server.
    err_path = tmp_path_factory.mktemp("serve") / "stderr.log"
    with ReadyProcess(cmd, READY, stderr_path=err_path) as child:
        url = child.start(timeout_s=300).split()[0]
        child.proc.stderr_path = err_path
        yield url, child.proc


def _headers() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_openai_client_streams_chat_with_usage(server):
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert finish == ["length"]
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 12
    assert text  # random weights, but 12 tokens of a byte-level BPE are never all empty

    # Greedy is deterministic: the same request through the non-streaming path agrees.
    whole = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].message.content == text
    assert whole.usage.completion_tokens == 12

    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="1024"):
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as r:
        return await r.text()


async def _used_blocks(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    text = await _metrics(session, url)
    return _metric(text, "tierguard:kv_blocks_used"), _metric(text, "vllm:num_requests_running")


def _aborted_and_generated(text: str) -> tuple[float, float]:
    try:
        aborted = _metric(text, 'vllm:request_success_total{finished_reason="abort",model_name="tiny"}')
    except AssertionError:
        aborted = 0.0
    return aborted, _metric(text, "vllm:generation_tokens_total")


async def _wait_idle(session: aiohttp.ClientSession, url: str, timeout: float = 20.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    used = await _used_blocks(session, url)
    while used != (0, 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        used = await _used_blocks(session, url)
    return used


def test_disconnect_mid_stream_frees_blocks(server):
    url, _ = server
    body = {
        "model": "tiny",
        "prompt": "once upon a time " * 5,
        "max_tokens": 800,
        "ignore_eos": True,
        "stream": True,
    }

    async def go():
        async with aiohttp.ClientSession(headers=_headers()) as s:
            assert await _wait_idle(s, url) == (0, 0)
            before = _aborted_and_generated(await _metrics(s, url))
            resp = await s.post(url + "/v1/completions", json=body)
            assert resp.status == 200
            for _ in range(3):
                await resp.content.readline()
            busy = await _used_blocks(s, url)
            resp.close()  # hang up mid-stream
            idle = await _wait_idle(s, url)
            return busy, idle, before, _aborted_and_generated(await _metrics(s, url))

    busy, after, before, later = asyncio.run(go())
    assert busy[0] > 0 and busy[1] == 1
    assert after == (0, 0)
    # Freed because it was aborted, not because it ran to its 800 tokens.
    assert later[0] == before[0] + 1
    assert later[1] - before[1] < 800


def test_cancelled_non_streaming_request_frees_blocks(server):
    url, _ = server
    body = {"model": "tiny", "prompt": "tell me a story", "max_tokens": 900, "ignore_eos": True}

    async def go():
        async with aiohttp.ClientSession(headers=_headers()) as s:
            assert await _wait_idle(s, url) == (0, 0)
            before = _aborted_and_generated(await _metrics(s, url))
            task = asyncio.ensure_future(s.post(url + "/v1/completions", json=body))
            deadline = time.monotonic() + 10
            while (await _used_blocks(s, url))[0] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            busy = await _used_blocks(s, url)
            task.cancel()
            idle = await _wait_idle(s, url)
            return busy, idle, before, _aborted_and_generated(await _metrics(s, url))

    busy, after, before, later = asyncio.run(go())
    assert busy[0] > 0
    assert after == (0, 0)
    assert later[0] == before[0] + 1
    assert later[1] - before[1] < 900


def test_metrics_count_requests_and_steps(server):
    url, _ = server

    async def go():
        async with aiohttp.ClientSession(headers=_headers()) as s:
            before = await (await s.get(url + "/metrics")).text()
            r = await s.post(
                url + "/v1/completions",
                json={"model": "tiny", "prompt": "hello", "max_tokens": 5, "ignore_eos": True},
            )
            assert r.status == 200
            after = await (await s.get(url + "/metrics")).text()
            return before, after

    before, after = asyncio.run(go())
    for name, delta in (
        ("vllm:generation_tokens_total", 5),
        ("vllm:e2e_request_latency_seconds_count", 1),
        ("vllm:time_to_first_token_seconds_count", 1),
    ):
        assert _metric(after, name) - _metric(before, name) == delta, name
    assert (
        _metric(after, "tierguard:step_duration_seconds_count")
        >= _metric(before, "tierguard:step_duration_seconds_count") + 5
    )
    assert _metric(after, "vllm:prefix_cache_queries_total") > 0


def test_sigterm_shuts_down_cleanly(server):
    # Runs last in this module (pytest keeps file order): the fixture's server goes away.
    _, proc = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert "Traceback" not in proc.stderr_path.read_text()
