"""bench/serve_vs_peers.py: a server whose greedy text does not agree with the float32
reference is invalid, however fast, and no goal counts it as met."""

from __future__ import annotations

import pytest

from tests.bench.bench_scripts import bench_module


@pytest.fixture(scope="module")
def peers():
    return bench_module("serve_vs_peers")


REF = ["The capital of France is Paris.", "Water boils at 100 degrees Celsius at sea level.",
       "A pump moves fluid by mechanical action.", "Seven days make a week."]


def encode(text: str) -> list[str]:
    return text.split()


def _level(tok_s: float, itl: float) -> dict:
    return {"valid": True, "invalid_reasons": [], "output_tok_s": tok_s, "itl_p50_ms": itl, "itl_p99_ms": itl * 2}


def test_agreement_passes_the_reference_and_fails_garbage(peers):
    same = peers.agreement(REF, list(REF), encode, 0.5, 0.75)
    assert same["valid"] and same["agreement"] == 1.0 and same["identical"] == 4
    longer = peers.agreement(REF, [t + " And more after the end." for t in REF], encode, 0.5, 0.75)
    assert longer["valid"] and longer["agreement"] == 1.0  # text past the reference's end is not judged
    late = peers.agreement(REF, ["The capital of France is Lyon.", *REF[1:]], encode, 0.5, 0.75)
    assert late["valid"] and late["agreement"] < 1.0 and late["first_token"] == 1.0
    garbage = peers.agreement(REF, ["zq zq zq zq zq"] * 4, encode, 0.5, 0.75)
    assert not garbage["valid"] and garbage["agreement"] == 0.0 and garbage["first_token"] == 0.0
    assert len(garbage["invalid_reasons"]) == 2
    failed = peers.agreement(REF, [None, *REF[1:]], encode, 0.5, 0.75)
    assert not failed["valid"] and "1 of 4 greedy requests failed" in failed["invalid_reasons"][0]


def test_a_fast_garbage_server_makes_the_run_invalid(peers):
    garbage = peers.agreement(REF, ["zq"] * 4, encode, 0.5, 0.75)
    fast = {"server": {"weight_bytes": 5e8}, "agreement": garbage,
            "levels": {"1": _level(500.0, 1.0), "8": _level(4000.0, 2.0), "32": _level(9000.0, 3.0)}}
    peer = {"server": {}, "agreement": peers.agreement(REF, list(REF), encode, 0.5, 0.75),
            "levels": {"1": _level(50.0, 20.0), "8": _level(200.0, 40.0), "32": _level(300.0, 60.0)}}
    peers.mark_disagreeing(fast)
    peers.mark_disagreeing(peer)
    assert not any(lv["valid"] for lv in fast["levels"].values())
    assert all(lv["valid"] for lv in peer["levels"].values())
    report = {"servers": {"tierguard-fp32": fast, "llamacpp-f32": peer}, "weight_read_ms": 1.0}
    targets = peers.targets(report)
    assert report["valid"] is False
    assert any("float32 reference" in why for why in report["invalid_reasons"])
    # the garbage server's numbers feed no goal: no ratio, no verdict
    assert targets["tierguard-fp32_c1_itl_over_llamacpp-f32"] is None
    assert targets["tierguard-fp32_c1_itl_le_llamacpp-f32"] is None
    assert targets["tierguard-fp32_c8_tok_s_ge_2x_best_peer"] is None
