"""LLMEngine behaviour: stops, sampling, preemption, aborts, accounting, observability."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import make_engine, prompt_ids
from tierguard.common.errors import TierguardError
from tierguard.engine.api import SamplingParams


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (p, sp) in requests.items():
        engine.add_request(rid, p, sp)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
        engine.check_integrity()
    return outs


def test_max_tokens_stop_token_and_single_finished(tiny_dir):
    engine = make_engine(tiny_dir)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = run(engine, {"a": (prompt_ids(1, 10), greedy)})["a"]
    tokens = [t for o in out for t in o.new_token_ids]
    assert len(tokens) == 8 and out[-1].finish_reason == "length"
    assert [o.finished for o in out].count(True) == 1 and out[-1].finished
    # Stop at the 4th greedy token via stop_token_ids (deterministic replay).
    stop = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[3]])
    out2 = run(engine, {"b": (prompt_ids(1, 10), stop)})["b"]
    got = [t for o in out2 for t in o.new_token_ids]
    assert got == tokens[: tokens.index(tokens[3]) + 1] and out2[-1].finish_reason == "stop"
    assert engine.stats().kv_blocks_used == 0


def test_stop_string_cuts_text_and_is_not_emitted(tiny_dir):
    engine = make_engine(tiny_dir)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = "".join(o.text_delta for o in run(engine, {"a": (prompt_ids(3, 12), greedy)})["a"])
    assert len(full) >= 6
    stop = full[3:6]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    out = run(engine, {"b": (prompt_ids(3, 12), params)})["b"]
    text = "".join(o.text_delta for o in out)
    assert text == full[: full.index(stop)]
    assert out[-1].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_dir):
    engine = make_engine(tiny_dir)
    p = prompt_ids(4, 9)
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = [t for o in run(engine, {"a": (p, sp)})["a"] for t in o.new_token_ids]
    crowd = {
        f"n{i}": (prompt_ids(40 + i, 7), SamplingParams(max_tokens=10, temperature=1.0)) for i in range(3)
    }
    crowd["a"] = (p, sp)
    together = [t for o in run(engine, crowd)["a"] for t in o.new_token_ids]
    assert alone == together
    other = SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
    assert [t for o in run(engine, {"c": (p, other)})["c"] for t in o.new_token_ids] != alone


def test_top_k_one_is_greedy(tiny_dir):
    engine = make_engine(tiny_dir)
    p = prompt_ids(5, 9)
    g = run(engine, {"g": (p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))})["g"]
    k = run(engine, {"k": (p, SamplingParams(max_tokens=6, temperature=1.5, top_k=1, ignore_eos=True))})["k"]
    assert [o.new_token_ids for o in g] == [o.new_token_ids for o in k]


def test_no_leaks_after_mixed_finish_abort_and_preemption(tiny_dir):
    rng = random.Random(0)
    engine = make_engine(tiny_dir, num_blocks=20, max_num_batched_tokens=24, max_num_seqs=6)
    shared = prompt_ids(9, 12)
    live: set[str] = set()
    for i in range(30):
        p = (shared if rng.random() < 0.5 else []) + prompt_ids(100 + i, rng.randint(1, 20))
        engine.add_request(
            f"r{i}", p, SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.7, ignore_eos=True)
        )
        live.add(f"r{i}")
        for _ in range(rng.randint(0, 3)):
            for o in engine.step():
                if o.finished:
                    live.discard(o.request_id)
            engine.check_integrity()
        if rng.random() < 0.3 and live:
            victim = rng.choice(sorted(live))
            out = engine.abort(victim)
            assert out is not None and out.finish_reason == "abort" and out.finished
            live.discard(victim)
            engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0 and stats.num_running == 0
    assert stats.prefix_cache_hits > 0


def test_validation_errors_name_the_numbers(tiny_dir):
    engine = make_engine(tiny_dir, max_model_len=64)
    with pytest.raises(TierguardError, match=r"60 tokens.*10.*64"):
        engine.add_request("x", list(range(5, 65)), SamplingParams(max_tokens=10))
    with pytest.raises(TierguardError, match="empty"):
        engine.add_request("y", [], SamplingParams())
    with pytest.raises(TierguardError, match="vocabulary"):
        engine.add_request("z", [10**6], SamplingParams())
    engine.add_request("dup", [5, 6], SamplingParams())
    with pytest.raises(TierguardError, match="already"):
        engine.add_request("dup", [5, 6], SamplingParams())


def test_step_listener_sees_prefill_and_decode(tiny_dir):
    engine = make_engine(tiny_dir, max_num_batched_tokens=16)
    steps = []
    engine.add_step_listener(steps.append)
    run(engine, {"a": (prompt_ids(6, 30), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))})
    assert steps[0].num_prefill_tokens == 16 and steps[0].num_decode_seqs == 0
    assert sum(s.num_prefill_tokens for s in steps) == 30
    assert steps[-1].num_decode_seqs == 1 and steps[-1].num_prefill_seqs == 0
    assert all(s.duration_s >= 0 for s in steps) and [s.step for s in steps] == sorted(s.step for s in steps)
    assert engine.stats().generation_tokens_total == 4 and engine.stats().prompt_tokens_total == 30
