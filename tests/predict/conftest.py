"""Shared pieces for the simulator's tests: a pinned cost model, a tiny model, recorders."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierguard.predict.costmodel import REGIME_FEATURES, Linear, StepCost

SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, max_position_embeddings=512, seed=0)


def pinned_cost(decode_ms=(4.0, 0.5, 0.001), chunk_ms=(6.0, 0.05, 0.00002, 0.1), gap_ms=None) -> StepCost:
    """Step costs fixed in advance (no noise): decode a0 + a1 x rows + a2 x keys, chunk
    steps b0 + b1 x rows + b2 x keys + b3 x sampled (ms)."""
    ms = 1e-3
    decode = Linear(REGIME_FEATURES["decode"], [x * ms for x in decode_ms])
    wide = Linear(REGIME_FEATURES["wide"], [x * ms for x in chunk_ms] + [0.0])
    gap = Linear(("1", "sampled"), [x * ms for x in gap_ms]) if gap_ms else None
    return StepCost({"decode": decode, "wide": wide}, 0, False, gap)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from tierguard.model.tiny import create_tiny

    return create_tiny(tmp_path_factory.mktemp("tiny-predict"), **SMALL)


def record_decisions(engine) -> list:
    """Wrap the engine's scheduler: every step's (scheduled ids and tokens, preempted ids)."""
    log: list = []
    schedule = engine.scheduler.schedule

    def wrapped():
        out = schedule()
        log.append((tuple((s.seq.seq_id, s.num_tokens) for s in out.scheduled),
                    tuple(s.seq_id for s in out.preempted)))
        return out

    engine.scheduler.schedule = wrapped
    return log
