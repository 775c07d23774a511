"""`sweep --predict-first`: the search that starts at a predicted boundary.

With pass/fail monotone in concurrency, it must find exactly the boundary the plain
ladder + bisection finds, wherever the prediction is (right, too high, too low, none),
and measure fewer cells when the prediction is right.
"""

from __future__ import annotations

import pytest

from tierguard.sweep.boundary import search, search_from
from tierguard.sweep.cells import CellVerdict
from tierguard.sweep.stats import P99

LADDER = [1, 2, 4, 8, 16]


def verdict(c: int, ok: bool) -> CellVerdict:
    return CellVerdict("ladder", 64, c, 8, 0, {"ttft": P99(1.0), "itl": P99(1.0)}, 0.0, ok, [] if ok else ["itl"])


def evaluator(threshold: int, seen: list[int]):
    def evaluate(c: int) -> CellVerdict:
        seen.append(c)
        return verdict(c, c <= threshold)

    return evaluate


@pytest.mark.parametrize("bisect", [True, False])
@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 5, 8, 11, 15, 16, 20])
@pytest.mark.parametrize("guess", [None, 1, 3, 4, 8, 12, 16])
def test_same_boundary_as_the_plain_search_wherever_the_prediction_is(threshold, guess, bisect):
    plain_seen, first_seen = [], []
    plain = search(LADDER, evaluator(threshold, plain_seen), bisect)
    fail = None if guess is None else next((c for c in LADDER if c > guess), None)
    got = search_from(LADDER, evaluator(threshold, first_seen), guess, fail, bisect, always=(1,))
    assert (got.max_concurrency, got.first_failing, got.ceiling_reached) == (
        plain.max_concurrency, plain.first_failing, plain.ceiling_reached)
    assert len(first_seen) == len(set(first_seen))  # each cell at most once


def test_a_right_prediction_measures_only_around_it():
    plain_seen, first_seen = [], []
    search(LADDER, evaluator(11, plain_seen), True)
    b = search_from(LADDER, evaluator(11, first_seen), 11, 12, True, always=(1,))
    assert b.max_concurrency == 11 and b.first_failing == 12
    assert sorted(first_seen) == [1, 11, 12]
    assert sorted(plain_seen) == [1, 2, 4, 8, 10, 11, 12, 16]


def test_the_sweep_measures_around_the_prediction_and_finds_the_same_boundary(tmp_path):
    from sweep.fake_bench import ServerModel, make_bench
    from sweep.helpers import schedule_variant

    from tierguard.sweep.matrix import parse_matrix
    from tierguard.sweep.runner import Sweep

    m = parse_matrix({
        "name": "t", "variants": [schedule_variant("a", 3)],
        "profile": {"context_lengths": [64], "output_len": 16, "num_requests": 8},
        "slices": {"ladder": [1, 2, 4, 8, 16]}, "slo": {"p99_ttft_ms": 200, "p99_itl_ms": 50},
        "uncertainty": {"bootstrap": 0},
    })
    plain = Sweep(m, tmp_path / "plain", bench=make_bench(ServerModel(capacity=3))).run()
    first = Sweep(m, tmp_path / "first", bench=make_bench(ServerModel(capacity=3)), predicted={"a": {64: (3, 4)}}).run()
    assert plain["variants"]["a"]["contexts"]["64"]["max_concurrency"] == 3
    assert first["variants"]["a"]["contexts"]["64"]["max_concurrency"] == 3
    assert plain["variants"]["a"]["contexts"]["64"]["evaluated"] == [1, 2, 3, 4]
    assert first["variants"]["a"]["contexts"]["64"]["evaluated"] == [1, 3, 4]
