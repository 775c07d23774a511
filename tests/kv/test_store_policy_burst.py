"""The store lane's token bucket banks at most `burst_s` of idle time (store_policy.py,
docs/cold-contract.md: 20 ms by default): after any idle stretch, the lane may run at
most that much store work before it waits for its share again. Pinned clock."""

from __future__ import annotations

import pytest

from tierguard.kv.store_policy import StorePolicy


@pytest.mark.parametrize("idle_s", [1.0, 3600.0])
def test_idle_time_banks_at_most_the_burst(idle_s):
    t0 = 1000.0
    p = StorePolicy(share=0.1, clock=lambda: t0)  # the default burst: 20 ms
    assert p.burst_s == 0.02
    now = t0 + idle_s  # 100 ms (or 6 min) of share earned while idle, but only 20 ms banked
    assert p.allow_run(now)
    p.charge(0.021)  # one job just over the burst
    assert not p.allow_run(now)  # the bank is spent: waits, however long it sat idle
    assert not p.allow_run(now + 0.0099)  # owes 1 ms: 10 ms of wall time at 10 %
    assert p.allow_run(now + 0.0101)
    assert p.stats().store_deferrals == 2


def test_a_burst_of_small_jobs_stops_at_the_bank():
    t0 = 50.0
    p = StorePolicy(share=0.5, burst_s=0.01, clock=lambda: t0)
    now = t0 + 600.0
    ran = 0
    while p.allow_run(now) and ran < 1000:
        p.charge(0.0015)
        ran += 1
    assert ran == 7  # 10 ms banked, 1.5 ms each: the seventh overdraws it
