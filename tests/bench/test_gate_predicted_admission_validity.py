"""bench/gate_predicted_admission.py's rules: a run with a failed request or an overload
that refused nothing is "valid": false, and its goals are null; a good run is judged."""

from __future__ import annotations

import copy

from tests.bench.bench_scripts import fresh_bench_module as load


def _cell(goodput: float, p99: float, refused: int = 0, retried: int = 0, got_in: float = 1.0) -> dict:
    return {"arrivals": 20, "admitted": 20, "refused": refused, "retries": retried,
            "retry_success": 1.0 if retried else None, "retried_clients": retried,
            "client_success": got_in if retried else None, "goodput_rps": goodput, "p99_ttft_ms": p99,
            "errors": []}


def _run() -> dict:
    rates = {}
    for rate, refused in (("0.5x", 0), ("1x", 0), ("2x", 5), ("4x", 9)):
        rates[rate] = {"predicted": _cell(4.0, 900.0, refused, refused),
                       "static-c2-q8": _cell(3.0, 1400.0, refused, refused, 0.5)}
    wrong = {"online": {"last_quarter_median_abs_error_ms": 30.0, "metrics_relative_bias": 0.05},
             "frozen": {"last_quarter_median_abs_error_ms": 300.0, "metrics_relative_bias": 0.7}}
    return {"engine": "serve", "slo_ms": 1000, "probe_errors": [], "rates": rates, "wrong_calibration": wrong}


def test_a_good_run_is_judged_and_a_broken_one_is_invalid_with_null_goals():
    bench = load("gate_predicted_admission")
    v = bench.Validity()
    goals = bench.judge(_run(), v)
    assert v.valid and all(goals.values()), goals
    bad = _run()
    bad["rates"]["4x"]["predicted"]["errors"] = ["status 502"]
    bad["rates"]["2x"]["predicted"]["refused"] = 0  # not an overload
    v = bench.Validity()
    goals = bench.judge(copy.deepcopy(bad), v)
    assert not v.valid and len(v.reasons) == 2
    assert set(goals.values()) == {None}
    worse = _run()
    worse["rates"]["2x"]["predicted"]["p99_ttft_ms"] = 1200.0
    worse["rates"]["4x"]["predicted"]["goodput_rps"] = 2.0
    v = bench.Validity()
    goals = bench.judge(worse, v)
    assert v.valid and goals["p99_within_slo"] is False and goals["goodput_at_least_best_static"] is False
