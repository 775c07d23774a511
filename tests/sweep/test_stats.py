from __future__ import annotations

import math

import numpy as np

from tierguard.sweep.stats import RequestSample, cdf_points, p99_with_interval, pooled, quantile


def ok(ttft: float, itl: list[float]) -> RequestSample:
    return RequestSample(
        ok=True,
        ttft_ms=ttft,
        itl_ms=itl,
        tpot_ms=float(np.mean(itl)),
        e2el_ms=ttft + sum(itl),
        max_stall_ms=max(itl) - float(np.median(itl)),
    )


def test_quantile_interpolates_as_vllm_bench_serve_and_handles_inf():
    v = np.array([1.0, 2.0, 3.0, math.inf])
    assert quantile(v, 0.5) == 2.5 == float(np.percentile(v[:3], 75))
    assert quantile(v, 0.99) == math.inf
    assert math.isnan(quantile(np.array([]), 0.99))


def test_failures_of_one_percent_make_p99_unbounded():
    good = [ok(50.0, [20.0] * 10) for _ in range(199)]
    assert p99_with_interval(good + [RequestSample(ok=False)], "ttft", 0, 0.9).value == 50.0  # 0.5 %
    one_in_100 = good[:99] + [RequestSample(ok=False)]
    assert p99_with_interval(one_in_100, "ttft", 0, 0.9).value == math.inf


def test_itl_pools_tokens_so_a_single_stall_shows_when_frequent_enough():
    # 20 requests x 10 gaps; 5 requests have one 500 ms gap: 2.5 % of tokens -> p99 is the stall
    reqs = [ok(50.0, [20.0] * 9 + ([500.0] if i % 4 == 0 else [20.0])) for i in range(20)]
    assert quantile(pooled(reqs, "itl"), 0.99) == 500.0
    # the per-request mean would have hidden it
    assert max(r.tpot_ms for r in reqs) < 100


def test_bootstrap_interval_brackets_point_and_narrows_with_samples():
    rng = np.random.default_rng(1)

    def sample(n):
        return [ok(float(x), [20.0]) for x in rng.normal(100, 10, n)]

    small = p99_with_interval(sample(30), "ttft", 300, 0.9)
    large = p99_with_interval(sample(2000), "ttft", 300, 0.9)
    for est in (small, large):
        assert est.low <= est.value <= est.high
    assert (large.high - large.low) < (small.high - small.low)


def test_cdf_points_thin_and_skip_inf():
    xs, ys = cdf_points(np.array([3.0, 1.0, 2.0, math.inf]), max_points=200)
    assert xs == [1.0, 2.0, 3.0]
    assert ys[-1] == 1.0
    xs, _ = cdf_points(np.arange(10000.0), max_points=50)
    assert len(xs) <= 50
