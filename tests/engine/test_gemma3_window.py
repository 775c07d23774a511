"""Gemma 3's sliding-window layers on a small random gemma3-shaped model (6 layers, one
full-attention layer in three, window 32 tokens, blocks of 4): the pool splits into layer
groups (1 full, 2 sliding, 2 layers each), and

- greedy tokens and logits match transformers' Gemma3ForCausalLM past the window, with
  prefill chunks shorter and longer than the window;
- a sliding group holds only its window's blocks while a sequence runs, and the engine's
  per-sequence count is `plan`'s;
- a prefix hit (device, host RAM, disk, Redis) brings back every full-attention block but
  of a sliding group only what the window needs, and the answers stay the same;
- preemption (recompute) under a tight pool keeps greedy outputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine.conftest import hf_step_logits, make_engine, prompt_ids
from tests.engine.test_tiers import run
from tierguard.engine.api import SamplingParams
from tierguard.kv.groups import NULL_BLOCK
from tierguard.model.tiny import create_tiny

WINDOW, BS = 32, 4
GEMMA = dict(
    layers=6, hidden=64, heads=4, kv_heads=2, vocab=512, max_position_embeddings=512, seed=5,
    arch="gemma3", sliding_window=WINDOW, sliding_pattern=3,
)  # fmt: skip
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def go(engine, prompts):
    return run(engine, prompts, GREEDY)
PROMPTS = [prompt_ids(300 + i, n) for i, n in enumerate((9, 45, 130))]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return create_tiny(tmp_path_factory.mktemp("tiny-gemma3"), **GEMMA)


@pytest.fixture(scope="module")
def reference(gemma_dir):
    return go(make_engine(gemma_dir, enable_prefix_caching=False), PROMPTS)


def test_layer_groups_of_the_pool(gemma_dir):
    engine = make_engine(gemma_dir)
    groups = engine.groups
    assert [(g.layers, g.window) for g in groups.groups] == [((2, 5), None), ((0, 1), WINDOW), ((3, 4), WINDOW)]
    assert engine.runner.kv_cache.shape[1] == 2  # a block spans one group's two layers
    assert not engine.runner.native_decode and engine.runner.decode_graphs is None
    assert "torch" in engine.compute_path


@pytest.mark.parametrize("chunk", [16, 64])
def test_greedy_and_logits_match_transformers_past_the_window(gemma_dir, hf_model, chunk):
    engine = make_engine(gemma_dir, max_num_batched_tokens=chunk)
    rows: dict[str, list] = {}
    engine.logits_hook = lambda ids, logits: [rows.setdefault(r, []).append(x) for r, x in zip(ids, logits, strict=True)]
    outputs = go(engine, PROMPTS)
    hf = hf_model(gemma_dir)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
        ref = hf_step_logits(hf, prompt, out)
        assert ref.argmax(-1).tolist() == out  # transformers' greedy choice at every step
        assert float((ref - torch.stack(rows[f"q0-{i}"])).abs().max()) < 1e-4


def test_sliding_groups_hold_only_the_window(gemma_dir, reference):
    engine = make_engine(gemma_dir, enable_prefix_caching=False, max_num_batched_tokens=16)
    peak: list[list[int]] = []

    def watch(_stats) -> None:
        for seq in engine.scheduler.running:
            if seq.seq_id.endswith("-2"):
                peak.append(engine.block_manager.blocks_per_group(seq))

    engine.add_step_listener(watch)
    assert go(engine, PROMPTS) == reference
    total = len(PROMPTS[2]) + GREEDY.max_tokens
    full, *sliding = peak[-1]
    assert full == math.ceil((total - 2) / BS)  # seen after the step before the last one
    window_blocks = math.ceil((WINDOW - 1) / BS) + 1
    assert all(n <= window_blocks for n in sliding) and max(sliding) >= window_blocks - 1
    # never more than the window plus one chunk, which is plan's per-sequence figure
    cap = engine.groups.group_blocks(1, total, 16, BS)
    assert max(max(p[1:]) for p in peak) <= cap < full


def test_engine_and_plan_agree_on_kv_per_sequence_and_fit(gemma_dir):
    from tierguard.plan.catalogue import load_model
    from tierguard.plan.dtypes import kv_format
    from tierguard.plan.kv import KVModel, KVSettings

    engine = make_engine(gemma_dir, num_blocks=1000, max_num_batched_tokens=64, max_model_len=512)
    spec = load_model(str(gemma_dir), [])
    block_bytes = engine.runner.device_pool.tensors[0][0].nbytes
    for context in (16, 33, 100, 512):
        settings = KVSettings(fmt=kv_format("float32", "float32"), max_model_len=512, block_size=BS,
                              max_num_batched_tokens=64)  # fmt: skip
        plan_bytes = KVModel(spec, settings).sequence_bytes(context)
        blocks = engine.groups.sequence_blocks(context, 64, BS)
        assert blocks * block_bytes == plan_bytes, context
        pool = engine.config.num_blocks * block_bytes
        assert pool // plan_bytes == engine.config.num_blocks // blocks


def test_prefix_hit_restores_only_what_the_window_needs(gemma_dir, reference):
    engine = make_engine(gemma_dir, num_blocks=400)
    assert go(engine, PROMPTS) == reference
    # The same long prompt again: every full block is a hit, each sliding group brings
    # back only the blocks its window reaches from the hit's end.
    match = engine.block_manager.lookup(_probe(PROMPTS[2]))
    hit = len(match.block_ids)
    assert hit == (len(PROMPTS[2]) - 1) // BS
    first = max(0, hit * BS - WINDOW + 1) // BS
    for ids in match.group_ids:
        assert ids[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in ids[first:]
    assert len(match.device_blocks()) == hit + 2 * (hit - first)
    assert go(engine, PROMPTS) == reference  # served from the cache, same answers
    assert engine.stats().prefix_cache_hits > 0
    engine.check_integrity()


def test_a_missing_window_block_shortens_the_hit(gemma_dir, reference):
    engine = make_engine(gemma_dir, num_blocks=400)
    go(engine, PROMPTS[2:])
    probe = _probe(PROMPTS[2])
    match = engine.block_manager.lookup(probe)
    hit = len(match.block_ids)
    # Forget one sliding block inside the window: no hit may need it any more.
    victim = match.group_ids[1][hit - 2]
    engine.pool.drop_cached(victim)
    shorter = engine.block_manager.lookup(probe)
    assert len(shorter.block_ids) == hit - 2
    assert go(engine, PROMPTS[2:]) == reference[2:]


def _probe(prompt):
    from tierguard.engine.sequence import Sequence

    return Sequence("probe", prompt, GREEDY, 0.0)


@pytest.fixture(scope="module")
def continuations(gemma_dir, reference):
    """Each prompt + its answer + a new turn: a hit on everything the first run computed."""
    prompts = [p + out + prompt_ids(400 + i, 7) for i, (p, out) in enumerate(zip(PROMPTS, reference, strict=True))]
    return prompts, go(make_engine(gemma_dir, enable_prefix_caching=False), prompts)


@pytest.mark.parametrize("medium", ["host", "disk", "remote"])
def test_tiers_move_full_blocks_and_windows(gemma_dir, reference, continuations, tmp_path, medium, request):
    tiers: dict = dict(kv_host_gib=0.01, num_blocks=400)
    if medium == "disk":
        tiers.update(kv_disk_dir=str(tmp_path), kv_disk_gib=0.05)
    if medium == "remote":
        redis = request.getfixturevalue("redis_server")
        tiers.update(kv_media={"remote": {"url": redis.url, "refresh_s": 0.02, "timeout_ms": 200}})
    first = make_engine(gemma_dir, **tiers)
    assert go(first, PROMPTS) == reference
    x = first.stats().flat()
    # What went out: every hashed full-attention block, and of each sliding group only the
    # window it still held when its sequence ended.
    blocks = [(len(p) + GREEDY.max_tokens - 1) // BS for p in PROMPTS]
    window = [min(b, math.ceil((WINDOW - 1) / BS) + 1) for b in blocks]
    assert sum(blocks) < x["kv_offloaded_blocks"] <= sum(blocks) + 2 * sum(window) < 3 * sum(blocks)
    if medium == "host":
        second = first
        second.pool.evict_all_cached()  # the device forgets; host RAM keeps the blocks
    else:
        first.close()  # the write-behind ends here
        second = make_engine(gemma_dir, **tiers)  # a new process would see the same medium
    try:
        if medium == "remote":
            from tests.kv.conftest import wait_until

            wait_until(lambda: len(second.connector.media["remote"].index) >= first.stats().flat()["kv_persisted_blocks"])
        prompts, expected = continuations
        before = second.stats().flat()["kv_blocks_loaded"]
        assert go(second, prompts) == expected
        loaded = second.stats().flat()["kv_blocks_loaded"] - before
        # A hit of n blocks loads n full-attention blocks and a window per sliding group.
        need = sum(b + 2 * (b - max(0, b * BS - WINDOW + 1) // BS) for b in blocks)
        assert loaded == need < 3 * sum(blocks)
        if medium != "host":
            assert second.stats().flat()[f"kv_blocks_loaded_from_{medium}"] > 0
        second.check_integrity()
    finally:
        second.close()


def test_preemption_with_layer_groups_keeps_greedy_outputs(gemma_dir, reference):
    engine = make_engine(gemma_dir, num_blocks=70, max_num_batched_tokens=16)
    try:
        assert go(engine, PROMPTS) == reference
        assert engine.stats().num_preemptions > 0
    finally:
        engine.close()
