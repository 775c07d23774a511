"""The long-session limit (`--max-long`) is fleet-wide under `--shared-state`, like the
total: two gates on one real redis-server never run more long requests together than the
limit, while short requests still take the free slots beside them. In process, so both
gates' counters and Redis' own record are visible; ordering is by events (a waiter queued
in the fleet's queue, a release), never by how long something took."""

from __future__ import annotations

import asyncio

import pytest

from tests.gate.test_shared_limits import _gate, _slots_drain, _start_up
from tierguard.gate.admission import Rejected, RequestInfo

LONG, SHORT = RequestInfo(5000), RequestInfo(10)


async def _queued(gate, waits: int) -> None:
    while gate.counters.waits < waits:
        await asyncio.sleep(0.01)


def test_a_long_request_on_one_gate_waits_for_the_long_slot_another_gate_holds(redis_server):
    async def main():
        kw = dict(max_concurrency=4, max_long=1, long_threshold=1000, max_queue_wait_ms=10_000)
        a, b = _gate(redis_server.url, "lg1", **kw), _gate(redis_server.url, "lg1", **kw)
        await _start_up(a, b)
        held = await a.acquire(LONG)
        assert held.klass == "long"
        assert (await a.store.counts())["long"] == 1
        waiting = asyncio.create_task(b.acquire(LONG))
        queued = asyncio.create_task(_queued(b, 1))
        done, _ = await asyncio.wait({waiting, queued}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert waiting not in done, "b ran a second long request while a held the fleet's only long slot"
        assert queued in done  # it waits in the fleet-wide queue
        # the total is not what holds it: short requests still run on either gate
        shorts = [await asyncio.wait_for(g.acquire(SHORT), 30) for g in (a, b)]
        counts = await a.store.counts()
        assert counts["slots"] == 3 and counts["long"] == 1 and counts["queued_long"] == 1
        assert not waiting.done()
        a.release(held)  # the long slot frees on a: b's waiter gets it
        ticket = await asyncio.wait_for(waiting, 30)
        assert ticket.klass == "long" and (await b.store.counts())["long"] == 1
        with pytest.raises(Rejected):  # and now a waits for b's, within its own wait limit
            await a.acquire(LONG, max_wait_s=0.2)
        for g, t in zip((a, b), shorts, strict=True):
            g.release(t)
        b.release(ticket)
        assert (await _slots_drain(a))["slots"] == 0
        await a.close()
        await b.close()

    asyncio.run(main())


def test_many_long_requests_across_two_gates_never_exceed_the_long_limit(redis_server):
    async def main():
        kw = dict(max_concurrency=6, max_long=2, long_threshold=1000, max_queue_wait_ms=20_000)
        a, b = _gate(redis_server.url, "lg2", **kw), _gate(redis_server.url, "lg2", **kw)
        await _start_up(a, b)
        running = {"now": 0, "max": 0}

        async def hold(gate):
            ticket = await gate.acquire(LONG)
            running["now"] += 1
            running["max"] = max(running["max"], running["now"])
            try:
                await asyncio.sleep(0.02)
            finally:
                running["now"] -= 1
                gate.release(ticket)

        await asyncio.gather(*(hold(g) for g in (a, b) for _ in range(5)))
        assert running["max"] == 2  # each gate alone would have run 2
        assert a.counters.waits + b.counters.waits >= 10 - 2
        assert a.counters.fallback_admissions == b.counters.fallback_admissions == 0
        assert (await _slots_drain(a))["slots"] == 0
        await a.close()
        await b.close()

    asyncio.run(main())
