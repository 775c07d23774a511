"""`p99_ttft_ms_incl_failed` in summary.json: the p99 TTFT with every failed, timed-out or
rejected request counted as infinitely late (cancelled ones are not part of the run), so
it is finite only while failures stay under 1 %, and a request that failed after its
first token counts as a failure, not as its TTFT."""

from __future__ import annotations

import pytest

from tierguard.bench.config import SLO
from tierguard.bench.records import CANCELLED, FAILED, OK, REJECTED, TIMEOUT, RequestRecord
from tierguard.bench.stats import summarize


def ok(i: int, ttft_ms: float) -> RequestRecord:
    t = ttft_ms / 1000
    return RequestRecord(index=i, status=OK, scheduled_s=0.0, first_token_s=t, end_s=t + 0.01,
                         chunk_times_s=[t, t + 0.01], chunk_tokens=[1, 1], output_tokens=2)


def failed(i: int, status: str = FAILED, first_token_ms: float | None = None) -> RequestRecord:
    t = None if first_token_ms is None else first_token_ms / 1000
    return RequestRecord(index=i, status=status, scheduled_s=0.0, first_token_s=t, end_s=0.5,
                         chunk_times_s=[] if t is None else [t], chunk_tokens=[] if t is None else [1],
                         error="boom")


def test_all_ok_is_the_p99_of_the_ttfts():
    recs = [ok(i, i + 1.0) for i in range(200)]  # 1 .. 200 ms
    s = summarize(recs, SLO())
    # one definition (common/percentile.py): both interpolate between the two p99 neighbours
    assert s["p99_ttft_ms_incl_failed"] == pytest.approx(198.01) == s["p99_ttft_ms"]


def test_under_one_percent_failures_the_tail_still_counts_them():
    recs = [ok(i, i + 1.0) for i in range(199)] + [failed(199)]  # 0.5 % failed
    s = summarize(recs, SLO())
    # the failure is the slowest sample; the p99 moves up among the TTFTs, still finite
    assert s["p99_ttft_ms_incl_failed"] == pytest.approx(198.01)
    assert s["p99_ttft_ms"] < s["p99_ttft_ms_incl_failed"]


@pytest.mark.parametrize("status", [FAILED, TIMEOUT, REJECTED])
def test_over_one_percent_failures_make_it_unbounded(status):
    recs = [ok(i, 10.0) for i in range(97)] + [failed(97 + i, status) for i in range(3)]
    s = summarize(recs, SLO())
    assert s["p99_ttft_ms_incl_failed"] is None  # infinite: the SLO is missed whatever the TTFTs say
    assert s["p99_ttft_ms"] == pytest.approx(10.0)  # what the successes alone would have claimed


def test_a_failure_after_its_first_token_counts_as_a_failure():
    recs = [ok(i, 10.0) for i in range(97)] + [failed(97 + i, first_token_ms=5.0) for i in range(3)]
    assert summarize(recs, SLO())["p99_ttft_ms_incl_failed"] is None


def test_cancelled_requests_are_not_failures():
    recs = [ok(i, 10.0) for i in range(97)] + [failed(97 + i, CANCELLED) for i in range(3)]
    assert summarize(recs, SLO())["p99_ttft_ms_incl_failed"] == pytest.approx(10.0)
