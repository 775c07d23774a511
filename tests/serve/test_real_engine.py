"""The HTTP layer on the real `AsyncLLMEngine` with the tiny model, in process.

In process (aiohttp test server on an ephemeral loopback port) so the test can read
`engine.stats()` directly: after a client hangs up mid-stream the engine itself must
report zero used blocks and nothing running.
"""

from __future__ import annotations

import asyncio

import pytest

from tierguard.serve.app import create_app

from .helpers import parse_sse, serve, wait_for

MAX_LEN = 512


@pytest.fixture(scope="module")
def engine():
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model

    return AsyncLLMEngine.from_model_dir(
        ensure_tiny_model(),
        model_name="tiny",
        max_model_len=MAX_LEN,
        kv_cache_gib=0.02,
        dtype="float32",
        device="cpu",
    )


def test_stream_usage_and_greedy_agreement(engine):
    msgs = [{"role": "user", "content": "What is paged attention?"}]

    async def go():
        async with serve(create_app(engine, prompt_tokens_details=True)) as client:
            body = {
                "model": "tiny",
                "messages": msgs,
                "max_tokens": 10,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
            raw = await (await client.post("/v1/chat/completions", json=body)).text()
            whole = await (
                await client.post(
                    "/v1/chat/completions", json={**body, "stream": False, "stream_options": None}
                )
            ).json()
            tok = await (await client.post("/tokenize", json={"messages": msgs})).json()
            return parse_sse(raw), whole, tok

    (events, done), whole, tok = asyncio.run(go())
    assert done
    content = [e for e in events if e["choices"]]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in content)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    counts = [e["usage"]["completion_tokens"] for e in content]
    assert counts == sorted(counts) and counts[-1] == 10  # continuous usage grows to the total
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == tok["count"]
    assert whole["choices"][0]["message"]["content"] == text  # greedy: stream and whole agree
    u = whole["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (
        tok["count"],
        10,
        tok["count"] + 10,
    )
    # The second identical prompt reuses the first one's full blocks (prefix cache).
    assert u["prompt_tokens_details"]["cached_tokens"] >= 16


def test_client_disconnect_frees_engine_blocks(engine):
    async def go():
        async with serve(create_app(engine)) as client:
            before = engine.stats().generation_tokens_total
            body = {"prompt": "abc " * 30, "max_tokens": 400, "ignore_eos": True, "stream": True}
            resp = await client.post("/v1/completions", json=body)
            for _ in range(3):
                await resp.content.readline()
            busy = engine.stats()
            resp.close()
            idle = await wait_for(
                lambda: engine.stats().kv_blocks_used == 0 and engine.stats().num_running == 0
            )
            return busy, idle, engine.stats(), before

    busy, idle, after, before = asyncio.run(go())
    assert busy.kv_blocks_used > 0 and busy.num_running == 1
    assert idle, after
    assert after.generation_tokens_total - before < 400  # aborted, not run to the end


def test_context_limit_and_tokenizer_round_trip(engine):
    async def go():
        async with serve(create_app(engine, served_model_name="tiny")) as client:
            tok = await (await client.post("/tokenize", json={"prompt": "hello world"})).json()
            detok = await (await client.post("/detokenize", json={"tokens": tok["tokens"]})).json()
            too_long = await client.post(
                "/v1/completions", json={"prompt": "hello world", "max_tokens": MAX_LEN}
            )
            return tok, detok, too_long.status, await too_long.json()

    tok, detok, status, err = asyncio.run(go())
    assert tok["max_model_len"] == MAX_LEN and tok["count"] == len(tok["tokens"]) > 0
    assert detok["prompt"].endswith("hello world")
    assert status == 400
    msg = err["error"]["message"]
    assert (
        str(MAX_LEN) in msg
        and f"{tok['count']} in the prompt" in msg
        and f"{MAX_LEN} for the completion" in msg
    )


def test_async_openai_client_and_stop_string(engine):
    import openai

    async def go():
        async with serve(create_app(engine, api_key="k")) as client:
            oai = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
            msgs = [{"role": "user", "content": "Count with me."}]
            stream = await oai.chat.completions.create(
                model="tiny",
                messages=msgs,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            # Stop at a plain-ASCII string taken from the second half of the greedy output.
            windows = (text[k : k + 3] for k in range(len(text) // 2, len(text) - 3))
            stop = next(w for w in windows if w.isascii() and w.isprintable())
            cut = await oai.chat.completions.create(
                model="tiny",
                messages=msgs,
                max_tokens=12,
                temperature=0,
                stop=[stop],
                extra_body={"ignore_eos": True},
            )
            await oai.close()
            return chunks, text, stop, cut

    chunks, text, stop, cut = asyncio.run(go())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert len(stop) == 3
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
