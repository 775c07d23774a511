"""Shared limits on a real Redis Cluster (tests/conftest.py: 3 masters, 3 replicas, shared by
the session): a fleet's keys in one slot, the limit held across gates, and a failover seen
through a redirect taken as an outage, after which no gate trusts Redis's count until every
gate had its turn to write its leases back. In process, driven call by call where the
order matters, so the assertions read the gates' own state and Redis's, never a clock.
The lease master killed in a flood is tests/engine/test_remote_cluster_engine.py."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.gate.test_shared_limits import _gate, _hold, _slots_drain, _start_up
from tierguard.gate.admission import RequestInfo
from tierguard.gate.leases import LeaseStore


def test_a_fleets_keys_and_channel_share_one_slot(redis_cluster):
    store = LeaseStore(redis_cluster.url, prefix="tierguard:gate")
    names = [*store._keys, store.channel]
    assert len(names) == 10 and all(n.startswith("{tierguard:gate}:") for n in names)
    assert len({redis_cluster.keyslot(n) for n in names}) == 1  # the cluster's own CLUSTER KEYSLOT
    with pytest.raises(ValueError, match="braces"):
        LeaseStore(redis_cluster.url, prefix="a{b}")


def test_two_gates_never_run_more_than_the_shared_limit_on_a_cluster(redis_cluster):
    async def main():
        prefix = f"c1-{os.urandom(4).hex()}"
        a, b = (_gate(redis_cluster.url, prefix, max_concurrency=3) for _ in range(2))
        await _start_up(a, b)
        running = {"now": 0, "max": 0}
        await asyncio.gather(*(_hold(g, RequestInfo(10), 0.05, running) for g in (a, b) for _ in range(8)))
        assert running["max"] == 3
        assert a.counters.waits + b.counters.waits >= 16 - 3
        assert a.counters.fallback_admissions == b.counters.fallback_admissions == 0
        assert a.counters.errors == b.counters.errors == 0
        assert (await _slots_drain(a))["slots"] == 0
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_failover_seen_through_a_redirect_holds_shared_admission_until_every_lease_is_back(redis_cluster):
    """The fleet's slot moves to another master (MOVED, followed by redis-py) and the new
    master lacks gate C's leases, as after a failover that lost the last writes. Gate A's
    next call succeeds, yet A takes it as an outage: it writes its leases back and stays on
    its local share; only after C's renewal wrote C's leases back (C saw the move too) and
    the settling time passed does A count on Redis again, and Redis then holds every lease."""

    async def main():
        prefix = f"c2-{os.urandom(4).hex()}"
        a, c = (_gate(redis_cluster.url, prefix, lease_ms=6000, max_concurrency=4) for _ in range(2))
        for g in (a, c):  # no background loops: the test makes every call
            await g._renew_once()
            g._reached = True
        await a._renew_once()  # both gates live in Redis: the local share is 4 // 2
        assert a.up and c.up and a.local.policy.max_concurrency == 2
        held_a = [await a.acquire(RequestInfo(10))]
        held_c = [await c.acquire(RequestInfo(10)) for _ in range(2)]
        slots_key = a.store._keys[0]
        slot = redis_cluster.keyslot(slots_key)
        new = next(p for p in redis_cluster.masters() if p != redis_cluster.master_of_slot(slot))
        redis_cluster.move_slot(slot, new)
        redis_cluster.client(new).zrem(slots_key, *[t.lease for t in held_c])  # the lost writes

        await a._renew_once()  # answered by the new master, through a redirect
        assert a.counters.failovers == 1 and a.store.master.endswith(f":{new}") and not a.up
        await a._renew_once()  # recovering: A's leases written back, yet it settles
        assert not a.up, "shared admission resumed before the other gates wrote their leases back"
        more = await a.acquire(RequestInfo(10), max_wait_s=0)  # the local share: A now runs 2 of 2
        assert a.counters.fallback_admissions == 1 and sum(a.local.stats().in_flight.values()) == 2

        await c._renew_once()  # C's renewal: its leases written back; it saw the move as well
        assert c.counters.readded == 2 and c.counters.failovers == 1 and not c.up
        for _ in range(400):  # until A's settling time has passed (a hang guard, not a bound)
            await asyncio.sleep(0.05)
            await a._renew_once()
            if a.up:
                break
        assert a.up
        in_redis = {m.decode() for m in redis_cluster.client(new).zrange(slots_key, 0, -1)}
        assert {t.lease for t in (*held_a, more, *held_c)} <= in_redis  # every lease recovered
        for t in (*held_a, more):
            a.release(t)
        for t in held_c:
            c.release(t)
        await asyncio.sleep(0.2)  # the releases run in the background
        a.check_integrity()
        await a.close()
        await c.close()

    asyncio.run(main())
