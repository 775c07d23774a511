"""Admission control inside `tierguard serve`: the gate's controller in front of the real engine.

The engine here is the real `AsyncLLMEngine` with the tiny model, so "slots" are real
generations: while `max_concurrency` of them run, the next request waits in the bounded
queue and is refused with 429 + Retry-After once it has waited `max_queue_wait_ms`.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tierguard.gate import AdmissionPolicy
from tierguard.serve.app import create_app

from .helpers import serve


@pytest.fixture(scope="module")
def engine():
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model

    return AsyncLLMEngine.from_model_dir(
        ensure_tiny_model(), model_name="tiny", max_model_len=1024, kv_cache_gib=0.02, dtype="float32", device="cpu"
    )


def _completion(max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}


def test_bounded_queue_rejects_with_retry_after_and_never_waits_longer(engine):
    """The admitted request's slot is held by the engine itself: a step listener keeps the
    engine thread after that request's first step until the others have their answers,
    so the order below holds on any CPU, however fast it decodes."""
    policy = AdmissionPolicy(max_concurrency=1, max_queue=1, max_queue_wait_ms=150)
    go_on = threading.Event()
    go_on.set()
    engine.add_step_listener(lambda _stats: go_on.wait(60))  # a no-op once set

    async def go():
        async with serve(create_app(engine, admission=policy)) as client:
            loop = asyncio.get_running_loop()

            async def one(i: int):
                await asyncio.sleep(0.02 * i)  # arrival order: the first one takes the only slot
                t0 = loop.time()
                r = await client.post("/v1/completions", json=_completion(50))
                body = await r.json()
                return r.status, r.headers.get("Retry-After"), (t0, loop.time()), body

            go_on.clear()  # the engine holds after its next step: the admitted request's prefill
            first = asyncio.create_task(one(0))
            others = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(1, 4))), 60)
            go_on.set()
            results = [await asyncio.wait_for(first, 60), *others]
            metrics = await (await client.get("/metrics")).text()
            return results, metrics

    try:
        results, metrics = asyncio.run(go())
    finally:
        go_on.set()
    statuses = [r[0] for r in results]
    assert statuses[0] == 200
    assert statuses.count(429) == 3, statuses  # one waited out its 150 ms, two found the queue full
    for _status, retry_after, _times, body in results[1:]:
        assert retry_after is not None and int(retry_after) >= 1
        assert body["error"]["code"] == 429
    # Times on the server's own loop (client and server share it here). The queued one was
    # told no at its 150 ms deadline, not before (a lower bound: a busy loop only adds),
    # while the slot it waited for was still held (the admitted request ended after it).
    # The two others were told no while it still waited: the queue was full (the counter).
    (_a0, a1), (w0, w1) = results[0][2], results[1][2]
    assert w1 - w0 >= 0.15 and w1 < a1
    assert 'tierguard_gate_decisions_total{decision="reject",reason="queue_full_interactive"} 2.0' in metrics
    assert 'tierguard_gate_decisions_total{decision="reject",reason="queue_wait_interactive"} 1.0' in metrics
    assert engine.stats().kv_blocks_used == 0


def test_admitted_stream_carries_class_and_long_requests_are_their_own_class(engine):
    policy = AdmissionPolicy(max_concurrency=4, long_threshold=64, max_long=1, max_queue=4, max_queue_wait_ms=5000)
    long_prompt = " ".join(["token"] * 200)

    async def go():
        async with serve(create_app(engine, admission=policy)) as client:
            r = await client.post("/v1/completions", json={**_completion(4), "stream": True})
            await r.read()
            short_class = r.headers.get("X-Tierguard-Class")
            r = await client.post("/v1/completions", json={**_completion(4), "prompt": long_prompt})
            await r.read()
            return short_class, r.headers.get("X-Tierguard-Class"), r.status

    short_class, long_class, status = asyncio.run(go())
    assert (short_class, long_class, status) == ("interactive", "long", 200)


def test_chat_over_the_input_cap_is_downgraded_keeping_the_system_prompt(engine):
    policy = AdmissionPolicy(max_concurrency=2, max_input_tokens=120, downgrade_reserve_tokens=8)
    filler = " ".join(["history"] * 60)
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(4):
        messages += [{"role": "user", "content": f"{i} {filler}"}, {"role": "assistant", "content": filler}]
    messages.append({"role": "user", "content": "and now?"})

    async def go():
        async with serve(create_app(engine, admission=policy)) as client:
            full = await (await client.post("/tokenize", json={"messages": messages})).json()
            r = await client.post("/v1/chat/completions",
                                  json={"model": "tiny", "messages": messages, "max_tokens": 4})
            body = await r.json()
            return full["count"], r.status, r.headers.get("X-Tierguard-Downgraded"), body

    full_count, status, downgraded, body = asyncio.run(go())
    assert full_count > 120
    assert status == 200, body
    before, after = (int(x) for x in downgraded.split("->"))
    assert before == full_count and after <= 120 - 8
    assert body["usage"]["prompt_tokens"] == after


def test_downgrade_runs_the_ids_it_counted_without_encoding_the_trimmed_chat_again():
    """The trimmed chat's ids come from the trim's own last count (one encode per count)."""
    from tierguard.gate import AdmissionController
    from tierguard.serve.admission import admitted

    calls: list[list[dict]] = []  # the message lists encoded, in order

    async def encode_chat(msgs: list[dict]) -> list[int]:
        calls.append(msgs)
        return [len(m["content"]) % 7 for m in msgs for _ in m["content"].split()]

    filler = " ".join(["w"] * 40)
    messages = [{"role": "system", "content": "s"}]
    messages += [{"role": r, "content": filler} for r in ("user", "assistant") * 3]
    messages.append({"role": "user", "content": "last"})
    controller = AdmissionController(AdmissionPolicy(max_concurrency=1, max_input_tokens=60,
                                                     downgrade_reserve_tokens=0))

    async def go():
        ids = await encode_chat(messages)
        calls.clear()
        async with admitted(controller, ids, "interactive", messages, encode_chat) as slot:
            return slot, list(calls)

    slot, encoded = asyncio.run(go())
    assert slot.downgraded_from is not None and len(slot.ids) <= 60
    assert slot.ids == asyncio.run(encode_chat(slot.messages))
    assert encoded and encoded[-1] is slot.messages
    # no list was encoded twice in a row (the trim's last count is reused, not redone)
    assert all(a is not b for a, b in zip(encoded, encoded[1:], strict=False))
