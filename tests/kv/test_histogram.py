"""The plain latency histogram the engine fills and /metrics exports."""

from __future__ import annotations

from tierguard.common.histogram import LatencyHistogram


def test_buckets_are_cumulative_and_end_with_inf():
    h = LatencyHistogram(bounds=(0.001, 0.01, 0.1))
    for s in (0.0005, 0.001, 0.002, 0.05, 0.5, 2.0):
        h.observe(s)
    assert h.count == 6
    # an observation equal to a bound falls in that bucket (Prometheus "le")
    assert h.cumulative() == [("0.001", 2), ("0.01", 3), ("0.1", 4), ("+Inf", 6)]
    assert abs(h.total_s - 2.5535) < 1e-9


def test_snapshot_is_a_copy():
    h = LatencyHistogram(bounds=(1.0,))
    snap = h.snapshot()
    h.observe(0.5)
    assert snap.count == 0 and h.count == 1
