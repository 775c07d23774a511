"""One request never takes the engine down; a stopped engine says so and answers everyone.

Against the real engine and tiny model in process (the serve app on a loopback port):
sampling fields out of range are a 400 naming the field, after which /health is 200 and
a plain request completes; an engine stopped on purpose (a fault injected by the test
into its step) answers /health with 503 naming the error, ends the request it was
streaming with an error event and the whole one with an error status, and refuses new
ones with 503 at once. Also: the gate's class header wins over a body's `request_class`
(here and through a real gate), and /detokenize decodes in the tokenizer pool.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from tierguard.serve.app import create_app

from .fake_engine import CharTokenizer, FakeEngine
from .helpers import gate, parse_sse, serve, url_of

ENGINE_STATE_HEADER = "X-Tierguard-Engine-State"  # what a gate ejects on (gate/upstreams.py)
PLAIN = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def _tiny_engine(max_model_len: int = 256):
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model

    return AsyncLLMEngine.from_model_dir(ensure_tiny_model(), model_name="tiny", max_model_len=max_model_len,
                                         kv_cache_gib=0.01, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def engine():
    return _tiny_engine()


async def _post(client, body: dict, path: str = "/v1/completions"):
    # json.dumps writes NaN and Infinity, which JSON lacks and Python's (and pydantic's) readers take
    async with client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(), r.headers


def _out_of_range(vocab: int) -> list[tuple[str, dict]]:
    return [
        ("top_k", {"top_k": 10**30, "top_p": 0.9}),  # unchecked: an int64 overflow in the batched sampler
        ("top_k", {"top_k": vocab + 1, "top_p": 0.9}),
        ("top_k", {"top_k": -2}),
        ("seed", {"seed": 2**64}),  # 65 bits; unchecked: make_generator raises while the request is added
        ("seed", {"seed": -(2**63) - 1}),
        ("stop", {"stop": ["x"] * 17}),
        ("stop", {"stop": "x" * 257}),
        ("stop", {"stop": ["ok", "y" * 300]}),
        ("stop_token_ids", {"stop_token_ids": [vocab]}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
        ("stop_token_ids", {"stop_token_ids": [1] * 65}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": float("inf")}),
        ("top_p", {"top_p": float("nan")}),
        ("max_tokens", {"max_tokens": 2**70}),
    ]


def test_out_of_range_sampling_is_a_400_naming_the_field_and_the_engine_serves_on(engine):
    vocab = engine.vocab_size

    async def go():
        async with serve(create_app(engine)) as client:
            answers = []
            for field, extra in _out_of_range(vocab):
                status, body, _ = await _post(client, {**PLAIN, **extra})
                answers.append((field, status, body))
                chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
                status, body, _ = await _post(client, chat, "/v1/chat/completions")
                answers.append((field, status, body))
            async with client.get("/health") as r:
                health = r.status, await r.json()
            # the bounds themselves are served: int64 seeds, top_k at the vocabulary, 16 stops
            edge = {**PLAIN, "seed": 2**63 - 1, "top_k": vocab, "top_p": 0.9, "temperature": 1e-300,
                    "stop": ["z" * 256] * 16, "stop_token_ids": [vocab - 1] * 64}
            return answers, health, await _post(client, edge), await _post(client, PLAIN)

    answers, health, edge, plain = asyncio.run(go())
    for field, status, body in answers:
        assert status == 400, (field, status, body)
        assert body["error"]["param"] == field, (field, body)
        assert field in body["error"]["message"], body
    assert health[0] == 200 and health[1]["status"] == "ok", health
    assert edge[0] == 200, edge[1]
    assert plain[0] == 200 and plain[1]["usage"]["completion_tokens"] >= 1, plain[1]
    assert engine.failure() is None


def test_a_stopped_engine_answers_every_request_and_fails_health():
    """The step raises (a fault no request owns) while a stream and a whole request run."""
    engine = _tiny_engine()
    real_step = engine.engine.step
    running, release = threading.Event(), threading.Event()

    def step():
        seqs = engine.engine.seqs
        if len(seqs) == 2 and all(s.num_output_tokens >= 1 for s in seqs.values()):
            running.set()  # both requests have had output: the stream's headers are out
            release.wait(60)
            raise RuntimeError("injected: device lost")
        return real_step()

    engine.engine.step = step
    long = {**PLAIN, "max_tokens": 100, "ignore_eos": True}

    async def go():
        async with serve(create_app(engine)) as client:
            whole = asyncio.create_task(_post(client, long))
            async with client.post("/v1/completions", json={**long, "stream": True}) as r:
                assert r.status == 200
                assert await asyncio.to_thread(running.wait, 60)
                release.set()
                streamed = await r.text()
            whole_status, whole_body, whole_headers = await asyncio.wait_for(whole, 60)
            async with client.get("/health") as h:
                health = h.status, await h.json(), h.headers.get(ENGINE_STATE_HEADER)
            later = await _post(client, PLAIN)
            tokenize = await _post(client, {"prompt": "still here"}, "/tokenize")
            return streamed, (whole_status, whole_body, whole_headers.get(ENGINE_STATE_HEADER)), health, later, tokenize

    streamed, whole, health, later, tokenize = asyncio.run(go())
    events, done = parse_sse(streamed)
    assert done and events[-1]["error"]["code"] == 500, events[-3:]
    assert "stopped while serving" in events[-1]["error"]["message"]
    assert whole[0] == 500 and "stopped while serving" in whole[1]["error"]["message"] and whole[2] == "dead", whole
    assert health[0] == 503 and health[1]["status"] == "dead" and health[2] == "dead", health
    assert "RuntimeError: injected: device lost" in health[1]["error"]
    assert later[0] == 503 and later[2].get(ENGINE_STATE_HEADER) == "dead", later[:2]
    assert "device lost" in later[1]["error"]["message"]
    assert tokenize[0] == 200  # what needs no engine still works


def test_a_stopped_engine_is_503_before_any_work():
    engine = FakeEngine()
    engine.dead = "engine stopped after an error: RuntimeError: boom"

    async def go():
        async with serve(create_app(engine)) as client:
            async with client.get("/health") as h:
                health = h.status, await h.json()
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            return health, await _post(client, chat, "/v1/chat/completions")

    health, chat = asyncio.run(go())
    assert health == (503, {"status": "dead", "error": engine.dead})
    assert chat[0] == 503 and "boom" in chat[1]["error"]["message"] and chat[2][ENGINE_STATE_HEADER] == "dead"
    assert engine.seen_params == []  # refused before the engine was asked


def test_the_class_header_wins_over_the_body():
    """serve alone: `X-Tierguard-Priority` (what the gate sends) beats a body's
    `request_class`; without the header the body's field still counts (direct clients)."""
    engine = FakeEngine()
    base = {"prompt": "hi", "max_tokens": 2}

    async def go():
        async with serve(create_app(engine)) as client:
            for body, headers in (({**base, "request_class": "interactive"}, {"X-Tierguard-Priority": "batch"}),
                                  ({**base, "request_class": "batch"}, {"X-Tierguard-Priority": "interactive"}),
                                  ({**base, "request_class": "batch"}, {"X-Tierguard-Class": "interactive"}),
                                  ({**base, "request_class": "batch"}, {})):
                async with client.post("/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()

    asyncio.run(go())
    assert engine.seen_classes == ["batch", "interactive", "interactive", "batch"]


def test_through_a_real_gate_the_gates_class_reaches_the_engine(tmp_path):
    """The gate sends the class it admitted a request as; a body's `request_class` cannot
    lift a request the gate took as batch, nor demote one, and the body's OpenAI/vLLM
    `service_tier` / `priority` count at the gate as they would at serve."""
    engine = FakeEngine()
    base = {"prompt": "hi", "max_tokens": 2}
    cases = [({**base, "request_class": "interactive"}, {"X-Tierguard-Priority": "batch"}, "batch"),
             ({**base, "request_class": "batch"}, {}, "interactive"),
             ({**base, "request_class": "interactive", "service_tier": "flex"}, {}, "batch"),
             ({**base, "priority": 5}, {}, "batch")]

    async def go():
        async with serve(create_app(engine)) as upstream, gate([url_of(upstream)], str(tmp_path)) as front:
            for body, headers, _ in cases:
                async with front.post("/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()

    asyncio.run(go())
    assert engine.seen_classes == [want for _, _, want in cases]


def test_detokenize_decodes_in_the_tokenizer_pool():
    """More than a few ids are decoded by a pool worker, not on the event loop's thread."""

    class SpyTokenizer(CharTokenizer):
        threads: list[str] = []

        def decode(self, token_ids, skip_special_tokens=True):
            self.threads.append(threading.current_thread().name)
            return super().decode(token_ids, skip_special_tokens)

    engine = FakeEngine()
    engine.tokenizer = SpyTokenizer()

    async def go():
        async with serve(create_app(engine, tokenizer_workers=1)) as client:
            loop_thread = threading.current_thread().name
            long = await _post(client, {"tokens": [ord("a")] * 500}, "/detokenize")
            short = await _post(client, {"tokens": [ord("b")] * 3}, "/detokenize")
            bad = await _post(client, {"tokens": [1, 2, 999]}, "/detokenize")
            return loop_thread, long, short, bad

    loop_thread, long, short, bad = asyncio.run(go())
    assert long[:2] == (200, {"prompt": "a" * 500}) and short[:2] == (200, {"prompt": "bbb"})
    assert bad[0] == 400 and bad[1]["error"]["param"] == "tokens"
    assert SpyTokenizer.threads[0] != loop_thread and SpyTokenizer.threads[0].startswith("tierguard-tok")
    assert SpyTokenizer.threads[1] == loop_thread  # three ids: inline, a worker would cost more
