"""Cells whose requests differ the way real ones do (fake_bench.py): streams cut after
some tokens, and a long gap in a few streams among many smooth ones. A failure that
carried tokens is still a miss, and a stall that only a few requests have still sets the
p99 ITL when there are enough of them (tokens are pooled, not averaged per request)."""

from __future__ import annotations

import pytest

from sweep.fake_bench import ServerModel, make_bench
from sweep.helpers import schedule_variant
from tierguard.sweep.matrix import parse_matrix
from tierguard.sweep.runner import Sweep


def one_context(num_requests: int = 40):
    return parse_matrix({
        "name": "t",
        "variants": [schedule_variant("a", 64)],
        "profile": {"context_lengths": [64], "output_len": 16, "num_requests": num_requests},
        "slices": {"ladder": [1, 2, 4]},
        "slo": {"p99_ttft_ms": 200, "p99_itl_ms": 50},
        "uncertainty": {"bootstrap": 50},
    })


@pytest.mark.parametrize("after", [0, 1, 8])
def test_a_stream_cut_after_its_first_tokens_is_a_miss(tmp_path, after):
    model = ServerModel(capacity=64, fail_every=10, fail_after_tokens=after)
    doc = Sweep(one_context(), tmp_path, bench=make_bench(model)).run()
    b = doc["variants"]["a"]["contexts"]["64"]
    assert b["max_concurrency"] is None  # 10 % cut streams: no concurrency meets the SLO
    assert "ttft" in b["limited_by"]


def test_a_long_gap_in_a_quarter_of_the_streams_sets_the_p99_itl(tmp_path):
    # one 200 ms gap in every 4th request's 15: 1.7 % of the gaps, above the p99's 1 %; a
    # per-request mean would put each stalled stream near 33 ms, inside the 50 ms SLO
    model = ServerModel(capacity=64, stall_every=4, stall_ms=200.0)
    doc = Sweep(one_context(), tmp_path, bench=make_bench(model)).run()
    b = doc["variants"]["a"]["contexts"]["64"]
    assert b["max_concurrency"] is None and b["limited_by"] == ["itl"]


def test_smooth_streams_with_their_own_cadence_pass(tmp_path):
    model = ServerModel(capacity=64, itl_spread=0.2)  # every request its own cadence, 16-24 ms
    doc = Sweep(one_context(), tmp_path, bench=make_bench(model)).run()
    b = doc["variants"]["a"]["contexts"]["64"]
    assert b["max_concurrency"] == 4 and b["ceiling_reached"]
