"""The bench's headline promise: TTFT is timed from each request's SCHEDULED send time,
so a request that waits for a concurrency slot carries that wait in its TTFT (no
coordinated omission).

A real schedule server (known TTFT and ITL, one request at a time through
`--max-concurrency 1`) and arrivals far faster than it serves them: every request after
the first waits for the one before it. Checked against the arrival plan and the server's
own record of when it wrote each first token (CLOCK_MONOTONIC, the bench's clock too),
never against how long anything took beyond what the server's schedule forces: all
bounds here are lower bounds that a slower machine only widens.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tierguard.bench.config import BenchConfig
from tierguard.bench.runner import run_bench
from tierguard.bench.schedule_server import ScheduleServer
from tierguard.bench.strategy import make_arrivals

TTFT_MS, ITL_MS, TOKENS, N, RATE, SEED = 100.0, 5.0, 4, 5, 200.0, 3
TIMER_MS = 2.0  # the server's loop timers (libuv's) have millisecond resolution: a write may come that early


def _truth(base_url: str) -> dict[str, dict]:
    with urllib.request.urlopen(base_url + "/truth?reset=1", timeout=30) as r:
        return {row["id"]: row for row in json.loads(r.read())["requests"]}


def test_ttft_counts_the_wait_for_a_slot_from_the_scheduled_send_time():
    with ScheduleServer(ttft_ms=TTFT_MS, itl_ms=ITL_MS) as server:
        _truth(server.base_url)  # forget the preflight probe
        cfg = BenchConfig(base_url=server.base_url, input_len=8, output_len=TOKENS, num_requests=N,
                          request_rate=RATE, max_concurrency=1, seed=SEED, show_progress=False, timeout=60)
        res = run_bench(cfg)
        truth = _truth(server.base_url)
    t0 = res.run_info["t0_monotonic"]
    planned = make_arrivals(RATE, 1.0, SEED).schedule(N)
    recs = sorted(res.records, key=lambda r: r.index)
    assert [r.status for r in recs] == ["ok"] * N
    service_s = (TTFT_MS + (TOKENS - 1) * ITL_MS) / 1000  # the least one request holds the slot
    for k, r in enumerate(recs):
        assert r.scheduled_s == pytest.approx(planned[k], abs=1e-9)  # the plan, not the slot
        # the server emits token one no earlier than TTFT after it started the request
        first_due = truth[r.response_id]["start"] - t0 + TTFT_MS / 1000
        assert r.ttft_ms >= (first_due - planned[k]) * 1000 - TIMER_MS  # TTFT spans from the plan
        assert r.ttft_ms == pytest.approx((r.first_token_s - planned[k]) * 1000, abs=1e-6)
        if k:
            prev = recs[k - 1]
            assert r.slot_s >= prev.end_s  # one slot: it waited for the request before it
            assert r.queue_wait_ms > 0
            assert r.ttft_ms >= r.queue_wait_ms + TTFT_MS - TIMER_MS  # the wait is inside its TTFT
    # k requests ahead of the last, each holding the slot for at least its schedule, then its own TTFT
    last = recs[-1]
    assert last.ttft_ms >= ((N - 1) * service_s + TTFT_MS / 1000 - planned[-1]) * 1000 - N * TIMER_MS
    s = res.summary
    assert s["max_ttft_ms"] == pytest.approx(max(r.ttft_ms for r in recs), abs=0.01)
    assert s["p99_queue_wait_ms"] > 0 and s["max_ttft_ms"] >= s["max_queue_wait_ms"] + TTFT_MS - TIMER_MS
