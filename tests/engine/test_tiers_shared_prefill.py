"""Interactive requests that arrive together prefill together, beside running decodes.

One chat's prefix is still on the device, the other's is in host RAM only: without the
hold, the first prefills beside the decodes at once and the second a step later, once its
load has landed, so every decoding stream pays two prefill-sized gaps instead of one.
"""

from __future__ import annotations

import time

from tests.engine.conftest import batch_then_chats, make_engine, prompt_ids
from tierguard.engine.api import SamplingParams

SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def _served(engine, prompt, params) -> None:
    """Serve one request and wait for its blocks' copy to host RAM as well (`generate`
    returns at the last token, with the copy still in flight)."""
    engine.add_request(f"warm-{engine.step_count}", prompt, params)
    while engine.has_unfinished():
        engine.step()


def _loads_landed(engine, timeout_s: float = 10.0) -> None:
    """Wait until every transfer job the connector submitted has finished, so that the
    next step's poll sees it: the test then does not depend on this machine's speed."""
    deadline = time.monotonic() + timeout_s
    while engine.connector.worker.queue_depth and time.monotonic() < deadline:
        time.sleep(0.001)


def _two_chats_beside_a_decode(tiny_dir, num_blocks: int) -> tuple[dict, list[list[tuple[str, int]]], list[list[int]]]:
    """Chat "a" has its prefix on the device, chat "b" in host RAM only; both return
    while a batch request decodes. Returns the outputs, every step's prefill chunks
    (request id, tokens) and the reference outputs of an engine without tiers."""
    a, b, batch = prompt_ids(80, 40), prompt_ids(81, 40), prompt_ids(82, 20)
    a_turn, b_turn = a + prompt_ids(83, 8), b + prompt_ids(84, 8)
    plain = make_engine(tiny_dir)
    expected = plain.generate([batch], LONG) + plain.generate([a_turn, b_turn], PARAMS)
    engine = make_engine(tiny_dir, num_blocks=num_blocks, kv_host_gib=0.01)
    try:
        _served(engine, b, SHORT)
        engine.pool.evict_all_cached()  # b's prefix is in host RAM only
        _served(engine, a, SHORT)  # a's prefix stays on the device (cached, free)
        chunks: list[list[tuple[str, int]]] = []
        schedule = engine.scheduler.schedule

        def spy():
            out = schedule()
            chunks.append([(s.seq.seq_id, s.num_tokens) for s in out.scheduled if s.num_tokens > 1])
            return out

        engine.scheduler.schedule = spy
        out = batch_then_chats(engine, batch, {"a": a_turn, "b": b_turn}, PARAMS, long_params=LONG,
                               after_step=lambda: _loads_landed(engine))
        return out, chunks, expected
    finally:
        engine.close()


def _first_chunk_step(chunks: list[list[tuple[str, int]]], rid: str) -> tuple[int, int]:
    return next((i, n) for i, step in enumerate(chunks) for r, n in step if r == rid)


def test_a_ready_chat_waits_for_one_loading_from_host_and_they_prefill_in_one_step(tiny_dir):
    out, chunks, expected = _two_chats_beside_a_decode(tiny_dir, num_blocks=128)
    assert [out["batch"], out["a"], out["b"]] == expected
    (step_a, _), (step_b, _) = _first_chunk_step(chunks, "a"), _first_chunk_step(chunks, "b")
    assert step_a == step_b, chunks


def test_a_held_chat_keeps_its_device_prefix_while_the_other_loads(tiny_dir):
    """The pool is too small for b's load beside a's cached prefix: a's blocks are pinned
    while it waits, so b's load cannot evict them (a would recompute its whole prompt)."""
    out, chunks, expected = _two_chats_beside_a_decode(tiny_dir, num_blocks=28)
    assert [out["batch"], out["a"], out["b"]] == expected
    _, first = _first_chunk_step(chunks, "a")
    assert first <= 8, chunks  # only the new turn's tokens: its 40-token prefix survived
