"""The "remote" medium on a real Redis Cluster (tests/conftest.py: 3 masters, 3 replicas,
shared by the session): blocks spread over every shard and read by another replica, a
hung master costing only its own blocks (a breaker per node), redirections followed by
redis-py, and a cluster that cannot be reached at all. Counted, never timed."""

from __future__ import annotations

import os
import time

import pytest

from tests.kv.conftest import payload, wait_until
from tierguard.common.redis_server import free_port
from tierguard.kv.media import block_format as blk
from tierguard.kv.media.remote.tier import RemoteTier

BLOCK = 4096
STORED = blk.HEADER_LEN + BLOCK


def blocks(*hashes: int) -> list[tuple[int, bytes]]:
    return [(h, payload(h, BLOCK).numpy().tobytes()) for h in hashes]


def outs(*hashes: int) -> list[tuple[int, bytearray]]:
    return [(h, bytearray(BLOCK)) for h in hashes]


@pytest.fixture
def tiers(redis_cluster):
    """Tiers on the session's cluster, under a fingerprint of this test's own."""
    made: list[RemoteTier] = []
    fp = os.urandom(8).hex()

    def make(**kw) -> RemoteTier:
        kw.setdefault("refresh_s", 0.02)
        t = RemoteTier(redis_cluster.url, fp, BLOCK, 256 * STORED, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def by_master(cluster, tier: RemoteTier, hashes) -> dict[int, list[int]]:
    """Master port -> the hashes whose keys it serves, as the cluster itself says."""
    out: dict[int, list[int]] = {}
    for h in hashes:
        out.setdefault(cluster.master_of(tier.key(h)), []).append(h)
    return out


def test_blocks_spread_over_every_shard_and_another_replica_reads_them(tiers, redis_cluster):
    a, b = tiers(), tiers()
    hashes = list(range(1, 41))
    assert a.write_many(blocks(*hashes)) == [True] * 40
    assert set(by_master(redis_cluster, a, hashes)) == set(redis_cluster.masters())  # no hash tag: every shard
    wait_until(lambda: all(b.contains(h) for h in hashes), timeout=10)  # the journal, on one shard
    got = outs(*hashes, 99)
    assert b.read_many(got) == [True] * 40 + [False]
    assert all(bytes(data) == want for (_, data), (_, want) in zip(got, blocks(*hashes), strict=False))
    s = b.stats()
    assert s.learned == 40 and s.read_bytes == 40 * STORED and s.errors == 0 and b.healthy
    assert redis_cluster.client(redis_cluster.master_of(a.key(7))).pttl(a.key(7)) > 0  # with its TTL


def test_a_hung_master_costs_only_its_own_blocks(tiers, redis_cluster):
    """One master stopped (SIGSTOP): its blocks time out three times, then its breaker alone
    is open and they are refused without a round trip; the other shards' blocks are read
    all along, and writes still reach them. Resumed, the next read is the probe that closes
    it. (The refresh thread is idle here, so the counts are the reads' own.)"""
    a = tiers(timeout_ms=40, refresh_s=60)
    hashes = list(range(100, 160))
    assert a.write_many(blocks(*hashes)) == [True] * len(hashes)
    journal_master = redis_cluster.master_of(a.index.journal_key)
    hung = next(p for p in redis_cluster.masters() if p != journal_master)
    spread = by_master(redis_cluster, a, hashes)
    lost, kept = set(spread[hung]), [h for h in hashes if h not in spread[hung]]
    redis_cluster.pause(hung)
    try:
        for _ in range(5):
            assert a.read_many(outs(*hashes)) == [h not in lost for h in hashes]
        s = a.stats()
        assert s.errors == 3 and s.unavailable == 2 * len(lost)  # 3 timeouts opened it; then refused
        assert not a.healthy and f":{hung} (open)" in a.reason and a.reason.count("(open)") == 1
        assert a.writes_enabled  # the other shards still take writes
        fresh = list(range(500, 530))
        written = a.write_many(blocks(*fresh))
        on_hung = set(by_master(redis_cluster, a, fresh).get(hung, []))
        assert written == [h not in on_hung for h in fresh] and on_hung
        assert a.read_many(outs(*kept)) == [True] * len(kept)
    finally:
        redis_cluster.resume(hung)
    wait_until(lambda: a.read_many(outs(*hashes)) == [True] * len(hashes), timeout=15)
    assert a.healthy and a.stats().breaker_opened == 1


def test_the_refresh_thread_watches_a_failing_node(tiers, redis_cluster):
    """No reads at all: the refresh thread re-reads the topology and probes a hung master,
    so /health turns degraded and back without waiting for traffic."""
    a = tiers(timeout_ms=40)
    hung = next(p for p in redis_cluster.masters() if p != redis_cluster.master_of(a.index.journal_key))
    assert a.healthy
    redis_cluster.pause(hung)
    try:
        a.read_many(outs(*range(1, 30)))  # one read finds it hung
        wait_until(lambda: a.breakers[f"127.0.0.1:{hung}"].state == "open", timeout=15)
        assert not a.healthy
    finally:
        redis_cluster.resume(hung)
    wait_until(lambda: a.healthy, timeout=15)  # the probe went through the refresh thread


def test_redirections_are_followed_by_the_cluster_client(tiers, redis_cluster):
    """A block's slot migrated to another master behind the tier's back: while it moves the
    old master answers ASK, after it MOVED; redis-py follows both, and the block is read."""
    a = tiers()
    assert a.write_many(blocks(7)) == [True]
    slot = redis_cluster.keyslot(a.key(7))
    src = redis_cluster.master_of_slot(slot)
    dst = next(p for p in redis_cluster.masters() if p != src)
    redis_cluster.move_slot(slot, dst, finish=False)  # keys moved, slot still migrating: ASK
    got = outs(7)
    assert a.read_many(got) == [True] and bytes(got[0][1]) == blocks(7)[0][1]
    redis_cluster.finish_move(slot, dst)  # now MOVED
    assert a.read_many(outs(7)) == [True]
    assert a.client.get_node_from_key(a.key(7)).port == dst  # the client's slot map learned it
    s = a.stats()
    assert s.errors == 0 and s.misses == 0 and a.healthy


def test_a_cluster_out_of_reach_at_start_is_an_outage_not_an_error():
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    t = RemoteTier(url, "0123456789abcdef", BLOCK, 64 * STORED, refresh_s=0.02, timeout_ms=20)
    try:
        assert not t.healthy and "redis unreachable" in t.reason
        started = time.monotonic()
        for h in range(20):
            assert t.write_many(blocks(h)) == [False]
            assert t.read_many(outs(h)) == [False]
        assert time.monotonic() - started < 5.0  # hang guard only: the breaker answers without waiting
        s = t.stats()
        assert s.breaker_opened == 1 and s.unavailable > 0 and not t.writes_enabled
    finally:
        t.close()
