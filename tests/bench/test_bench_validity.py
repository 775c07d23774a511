"""The bench scripts' validity rules: a run that failed or did not exercise its subject is
"valid": false with reasons, and a goal measured on it is null, never met."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCH))
    try:
        import tier_scenario
        import validity

        yield tier_scenario, validity
    finally:
        sys.path.remove(str(BENCH))


def _result(counters: dict, errors: list[str] | None = None, requests: int = 9, empty: int = 0) -> dict:
    return {"requests": requests, "errors": errors or [], "empty_streams": empty, "tier_counters": counters}


def test_goal_is_null_on_an_invalid_run(bench_modules):
    _, validity = bench_modules
    v = validity.Validity()
    assert v.goal(True) is True and v.as_dict() == {"valid": True, "invalid_reasons": []}
    assert not v.require(False, "2 requests failed")
    assert v.goal(True) is None and v.as_dict() == {"valid": False, "invalid_reasons": ["2 requests failed"]}


def test_tier_scenario_requires_errors_free_streams_and_used_tiers(bench_modules):
    tier_scenario, _ = bench_modules
    a = argparse.Namespace(chats=4, chat_turns=2)
    used = {"kv_swap_out_blocks": 12.0, "kv_offloaded_blocks": 0.0, "kv_host_hits": 0.0, "kv_disk_hits": 5.0}
    assert tier_scenario.check("contract", _result(used), a).valid
    assert tier_scenario.check("reference", _result({}), a).valid  # no tiers to use
    # tiers configured but never read: the contract's numbers are the reference's
    idle = tier_scenario.check("contract", _result({**used, "kv_disk_hits": 0.0}), a)
    assert not idle.valid and "never read" in idle.reasons[0]
    # a counter missing from /metrics (renamed?) counts as not exercised, not as fine
    assert not tier_scenario.check("naive", _result({}), a).valid
    broken = tier_scenario.check("contract", _result(used, errors=["HTTP 500: boom"], requests=8, empty=1), a)
    assert len(broken.reasons) == 3 and "HTTP 500" in " ".join(broken.reasons)


def _phase(hits: float = 0.0, undecodable: float = 0.0, persisted: float = 0.0, texts=("a", "b"), errors=()) -> dict:
    counters = {"kv_disk_hits": hits, "kv_disk_undecodable": undecodable, "kv_persisted_blocks": persisted}
    return {"ttft_ms": [10.0, 12.0], "texts": list(texts), "errors": list(errors), "counters": counters}


def test_prefix_restart_requires_disk_hits_same_output_and_a_counted_wrong_key(bench_modules):
    sys.path.insert(0, str(BENCH))
    try:
        import prefix_restart
    finally:
        sys.path.remove(str(BENCH))
    a = argparse.Namespace(prefix_tokens=512, prefixes=2)
    good = {
        "save": _phase(persisted=64), "disk": _phase(hits=64), "recompute": _phase(),
        "save_encrypted": _phase(persisted=64), "disk_encrypted": _phase(hits=64),
        "wrong_key": _phase(undecodable=64), "key_a_again": _phase(hits=64),
    }  # fmt: skip
    out = prefix_restart.report(a, good, blocks=64)
    assert out["valid"] and out["ttft_ratio_disk_to_recompute"] == 1.0
    assert out["encrypted"]["restart_with_key_b"]["output_equals_recompute"]
    broken = {
        **good,
        "disk": _phase(hits=0),  # nothing came from disk
        "wrong_key": _phase(hits=3, undecodable=0, texts=("a", "x")),  # the wrong key read blocks
    }
    out = prefix_restart.report(a, broken, blocks=64)
    assert not out["valid"] and out["ttft_ratio_disk_to_recompute"] is None
    reasons = " | ".join(out["invalid_reasons"])
    for expected in ("disk: no disk hit", "wrong_key: output differs", "no undecodable", "a disk hit with the wrong key"):
        assert expected in reasons, reasons
    assert prefix_restart.report(a, {**good, "save": _phase(persisted=10)}, blocks=64)["valid"] is False
