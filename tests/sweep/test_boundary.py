from __future__ import annotations

from tierguard.sweep.boundary import search
from tierguard.sweep.cells import CellVerdict
from tierguard.sweep.stats import P99


def verdict(c: int, passed: bool, confident: bool = True) -> CellVerdict:
    return CellVerdict(
        slice="ladder",
        context=2048,
        concurrency=c,
        completed=10,
        failed=0,
        p99={"ttft": P99(100.0 if passed else 900.0, 90.0, 110.0)},
        max_stall_ms=None,
        passed=passed,
        missed=[] if passed else ["ttft"],
        confident=confident,
    )


def threshold_eval(limit: int, calls: list[int], uncertain: set[int] = frozenset()):
    def ev(c: int) -> CellVerdict:
        calls.append(c)
        return verdict(c, c <= limit, confident=c not in uncertain)

    return ev


LADDER = [1, 2, 4, 8, 16, 32]


def test_bisection_finds_exact_boundary_for_every_threshold():
    for limit in range(1, 32):
        calls: list[int] = []
        b = search(LADDER, threshold_eval(limit, calls))
        assert b.max_concurrency == limit, limit
        assert b.first_failing == limit + 1
        assert len(calls) == len(set(calls)), "a concurrency was evaluated twice"
        assert b.limited_by == ["ttft"]


def test_without_bisect_the_ladder_step_is_reported():
    b = search(LADDER, threshold_eval(11, []), bisect=False)
    assert (b.max_concurrency, b.first_failing) == (8, 16)


def test_all_pass_is_a_ceiling_and_none_pass_is_null():
    b = search(LADDER, threshold_eval(1000, []))
    assert b.ceiling_reached and b.max_concurrency == 32 and b.first_failing is None
    assert b.to_json()["uncertainty"]["range"] == [32, None]
    b = search(LADDER, threshold_eval(0, []))
    assert b.max_concurrency is None and b.first_failing == 1
    assert b.to_json()["max_concurrency"] is None


def test_first_step_failing_above_one_bisects_below_it():
    calls: list[int] = []
    b = search([8, 16], threshold_eval(3, calls))
    assert b.max_concurrency == 3
    assert 4 in calls and 8 in calls


def test_stops_at_first_failure_even_if_higher_passes():
    def ev(c: int) -> CellVerdict:
        return verdict(c, c != 4)

    b = search(LADDER, ev)
    assert b.max_concurrency == 3 and b.first_failing == 4
    assert 8 not in b.evaluated if hasattr(b, "evaluated") else 8 not in [p.concurrency for p in b.points]


def test_uncertain_cells_widen_the_range():
    b = search(LADDER, threshold_eval(5, [], uncertain={5, 6}))
    assert b.max_concurrency == 5
    lo, hi = b.to_json()["uncertainty"]["range"]
    assert lo == 4  # 5 passed, but not confidently
    assert hi is not None and hi >= 6  # 6's miss was not confident; 8's was


def test_an_uncertain_first_miss_runs_the_next_step_for_the_range_only():
    """Without bisection (demo --quick) an uncertain miss at 4 would leave the range open
    above; the next ladder step bounds it, and the boundary still ends at the first miss."""
    calls: list[int] = []
    b = search(LADDER, threshold_eval(2, calls, uncertain={4}), bisect=False)
    assert (b.max_concurrency, b.first_failing) == (2, 4)
    assert calls == [1, 2, 4, 8]
    assert b.to_json()["uncertainty"]["range"] == [2, 7]
    calls.clear()
    b = search(LADDER, threshold_eval(2, calls), bisect=False)  # a confident miss: nothing more
    assert calls == [1, 2, 4] and b.to_json()["uncertainty"]["range"] == [2, 3]
