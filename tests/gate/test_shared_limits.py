"""Shared limits on a real redis-server: two admission controllers (two gates) on one Redis.

In process, so the assertions can see both sides; gate processes, one of them SIGKILLed,
are in test_fleet_shared.py. Assertions read the gates' own counters and Redis' own
record (slots held, leases reaped), never how long something took: waits are bounded only
by generous hang guards, and how fast slots come back is measured by
bench/fleet_shared_limits.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tierguard.gate.admission import AdmissionPolicy, Rejected, RequestInfo
from tierguard.gate.leases import LeaseStore
from tierguard.gate.shared_admission import SharedAdmission


def _gate(url: str, prefix: str, lease_ms: int = 1500, **policy) -> SharedAdmission:
    store = LeaseStore(url, prefix=prefix, lease_ms=lease_ms, timeout_s=0.2)
    return SharedAdmission(AdmissionPolicy(**{"max_queue_wait_ms": 5000, **policy}), store)


async def _hold(gate: SharedAdmission, info: RequestInfo, seconds: float, running: dict) -> float:
    t0 = time.monotonic()
    ticket = await gate.acquire(info)
    running["now"] += 1
    running["max"] = max(running["max"], running["now"])
    try:
        await asyncio.sleep(seconds)
    finally:
        running["now"] -= 1
        gate.release(ticket)
    return time.monotonic() - t0


async def _start_up(*gates: SharedAdmission, timeout_s: float = 30.0) -> None:
    """Start the gates and wait until each is up and counts them all live: on a loaded host
    a gate's first call can time out, and that gate joins a renewal later (still correct,
    but the test is about shared limits, so it waits for them)."""
    for g in gates:
        await g.start()
    deadline = time.monotonic() + timeout_s
    while not all(g.up and g.counters.live_gates == len(gates) for g in gates):
        assert time.monotonic() < deadline, [(g.up, g.counters.live_gates) for g in gates]
        await asyncio.sleep(0.05)


async def _slots_drain(gate: SharedAdmission, timeout_s: float = 30.0) -> dict:
    """Releases go to Redis in the background: poll the counts until no slot is held (or time out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = await gate.store.counts()
        if counts["slots"] == 0 or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.05)


def test_two_gates_never_run_more_than_the_shared_limit(redis_server):
    async def main():
        a, b = _gate(redis_server.url, "t1", max_concurrency=3), _gate(redis_server.url, "t1", max_concurrency=3)
        await _start_up(a, b)
        running = {"now": 0, "max": 0}
        jobs = [_hold(g, RequestInfo(10), 0.05, running) for g in (a, b) for _ in range(8)]
        waited = await asyncio.gather(*jobs)
        assert running["max"] == 3  # each gate alone would have run 3
        assert len(waited) == 16
        assert a.counters.waits + b.counters.waits >= 16 - 3  # the others waited for a fleet slot
        assert a.counters.fallback_admissions == b.counters.fallback_admissions == 0
        counts = await _slots_drain(a)
        assert counts["slots"] == 0 and sum(v for k, v in counts.items() if k.startswith("queued")) == 0
        a.check_integrity()
        b.check_integrity()
        await a.close()
        await b.close()

    asyncio.run(main())


def test_queue_bound_and_class_order_are_fleet_wide(redis_server):
    async def main():
        kw = dict(max_concurrency=1, max_queue=2, max_long=1, long_threshold=1000)
        a, b = _gate(redis_server.url, "t2", **kw), _gate(redis_server.url, "t2", **kw)
        await _start_up(a, b)
        held = await a.acquire(RequestInfo(10))
        order: list[str] = []

        async def wait_then_note(gate, info, name):
            ticket = await gate.acquire(info)
            order.append(name)
            await asyncio.sleep(0.02)
            gate.release(ticket)

        async def queued(gate: SharedAdmission, waits: int) -> None:  # its waiter is in the fleet's queue
            while gate.counters.waits < waits:
                await asyncio.sleep(0.01)

        batch = asyncio.create_task(wait_then_note(a, RequestInfo(10, priority="batch"), "batch-on-a"))
        await asyncio.wait_for(queued(a, 1), 30)
        first = asyncio.create_task(wait_then_note(b, RequestInfo(10), "interactive-on-b"))
        await asyncio.wait_for(queued(b, 1), 30)
        second = asyncio.create_task(wait_then_note(a, RequestInfo(10), "interactive-on-a"))
        await asyncio.wait_for(queued(a, 2), 30)
        # two interactive waiters across both gates fill the interactive queue (max_queue 2)
        with pytest.raises(Rejected) as full:
            await b.acquire(RequestInfo(10))
        assert full.value.reason == "queue_full_interactive"
        a.release(held)
        await asyncio.gather(batch, first, second)
        # interactive before batch, FIFO within a class, whichever gate they came through
        assert order == ["interactive-on-b", "interactive-on-a", "batch-on-a"]
        await a.close()
        await b.close()

    asyncio.run(main())


def test_slots_of_a_gate_that_stopped_renewing_come_back_within_the_lease(redis_server):
    async def main():
        lease_ms = 600
        gate = _gate(redis_server.url, "t3", lease_ms=lease_ms, max_concurrency=2)
        await _start_up(gate)
        # a "dead gate": it took both slots and never renews or releases them
        dead = LeaseStore(redis_server.url, prefix="t3", lease_ms=lease_ms, timeout_s=0.2)
        for _ in range(2):
            r = await dead.acquire(0, False, dead.new_id(), queued=False, max_concurrency=2, max_long=2, max_queue=8)
            assert r.granted
        assert (await gate.store.counts())["slots"] == 2
        ticket = await asyncio.wait_for(gate.acquire(RequestInfo(10)), 30)  # a hang guard, not a bound
        # it waited, and what freed its slot was a dead lease reaped in Redis, not a release
        assert gate.counters.lease_expiries >= 1 and gate.counters.waits == 1
        assert (await gate.store.counts())["slots"] <= 2
        gate.release(ticket)
        await dead.close()
        await gate.close()

    asyncio.run(main())


def test_redis_killed_falls_back_to_the_local_share_and_recovers(redis_server):
    async def main():
        kw = dict(max_concurrency=4, max_long=2, max_queue_wait_ms=2000)
        a, b = _gate(redis_server.url, "t4", lease_ms=900, **kw), _gate(redis_server.url, "t4", lease_ms=900, **kw)
        await _start_up(a, b)
        held = [await a.acquire(RequestInfo(10)) for _ in range(4)]
        queued = asyncio.create_task(a.acquire(RequestInfo(10)))  # the 5th waits in the shared queue
        await asyncio.sleep(0.1)
        assert not queued.done() and a.counters.waits == 1
        redis_server.kill()
        for t in held[:3]:
            a.release(t)  # a now runs 1: below its local share of 4 // 2 live gates = 2
        # the waiter noticed Redis was gone and took a local slot instead (within its 2 s
        # wait limit: it was admitted, not refused)
        held = [held[3], await asyncio.wait_for(queued, 30)]
        assert not a.up and a.local.policy.max_concurrency == 2 and a.counters.fallback_admissions == 1
        # b: up to its share, then refused by its wait limit; nothing hangs on the dead Redis
        b_tickets = [await asyncio.wait_for(b.acquire(RequestInfo(10)), 30) for _ in range(2)]
        with pytest.raises(Rejected):
            await asyncio.wait_for(b.acquire(RequestInfo(10), max_wait_s=0.2), 30)
        assert b.counters.fallback_admissions == 2 and b.counters.errors >= 1
        # Redis comes back (empty): the renewals write back what still runs, shared limits resume
        redis_server.restart()
        deadline = time.monotonic() + 30
        while not (a.up and b.up) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert a.up and b.up
        assert (await a.store.counts())["slots"] == 4  # a's two and b's two, all still running
        assert a.counters.readded == 2 and b.counters.readded == 2
        with pytest.raises(Rejected):  # the fleet is full again by the shared count
            await a.acquire(RequestInfo(10), max_wait_s=0.2)
        for t in held:
            a.release(t)
        for t in b_tickets:
            b.release(t)
        assert (await _slots_drain(a))["slots"] == 0
        await a.close()
        await b.close()

    asyncio.run(main())


def test_unreachable_at_start_never_hangs_and_admits_within_the_share():
    async def main():
        gate = SharedAdmission(AdmissionPolicy(max_concurrency=6, max_queue_wait_ms=100),
                               LeaseStore("redis://127.0.0.1:9/0", lease_ms=900, timeout_s=0.05), min_gates=3)
        await asyncio.wait_for(gate.start(), 30)  # hang guards: a dead Redis must not block
        tickets = [await asyncio.wait_for(gate.acquire(RequestInfo(5)), 30) for _ in range(2)]
        with pytest.raises(Rejected):
            await asyncio.wait_for(gate.acquire(RequestInfo(5)), 30)
        assert not gate.up and gate.counters.fallback_admissions == 2
        for t in tickets:
            gate.release(t)
        await gate.close()

    asyncio.run(main())


def test_one_stall_is_not_an_outage_but_a_hung_redis_is(redis_server):
    """Calls in flight when Redis stalls all time out together: that is one strike's worth
    of evidence, not three (on CI such a stall dropped a gate to its local share while the
    other held the fleet's slots). Redis hung for longer than three timeouts is an outage."""

    async def main():
        gate = _gate(redis_server.url, "t6", max_concurrency=8)  # timeout 0.2 s
        await _start_up(gate)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            stalled = [asyncio.create_task(gate.acquire(RequestInfo(10))) for _ in range(4)]
            await asyncio.sleep(0.3)  # every call in flight has timed out by now
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        tickets = await asyncio.wait_for(asyncio.gather(*stalled), 5)
        assert gate.counters.errors >= 3  # several calls failed in the stall
        assert gate.up and gate.counters.fallback_admissions == 0
        assert (await gate.store.counts())["slots"] == 4  # all four hold fleet-wide leases
        for t in tickets:
            gate.release(t)

        errors = gate.counters.errors
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # now hung for good
        try:
            ticket = await asyncio.wait_for(gate.acquire(RequestInfo(10)), 30)
            assert not gate.up and gate.counters.fallback_admissions == 1
            assert gate.counters.errors - errors >= 3  # three strikes, not the first timeout
            gate.release(ticket)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not gate.up:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await gate.close()

    asyncio.run(main())
