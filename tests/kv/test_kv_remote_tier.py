"""The "remote" medium against a real `redis-server` (tests/conftest.py starts one on a free
loopback port): shared blocks, the local index and its journal, TTL, confirmation on
load, the budget, codecs, and Redis refusing, hanging, or dying with SIGKILL."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from tests.kv.conftest import FP, payload, wait_until
from tierguard.common.errors import TierguardError
from tierguard.common.redis_server import RedisServer, free_port
from tierguard.kv.guard import ColdContractViolation, decode_guard
from tierguard.kv.media import block_format as blk
from tierguard.kv.media.remote.breaker import BreakerSet
from tierguard.kv.media.remote.tier import RemoteTier

BLOCK = 4096
STORED = blk.HEADER_LEN + BLOCK


def blocks(*hashes: int) -> list[tuple[int, bytes]]:
    return [(h, payload(h, BLOCK).numpy().tobytes()) for h in hashes]


def outs(*hashes: int) -> list[tuple[int, bytearray]]:
    return [(h, bytearray(BLOCK)) for h in hashes]


@pytest.fixture
def tiers(redis_server):
    made: list[RemoteTier] = []

    def make(fp: str = FP, capacity: int = 64 * STORED, **kw) -> RemoteTier:
        kw.setdefault("refresh_s", 0.02)
        t = RemoteTier(redis_server.url, fp, BLOCK, capacity, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


class XorCodec:
    """A stand-in for an encrypting codec: proves the medium goes through `BlockCodec`."""

    codec_id = 7

    def __init__(self, key: int) -> None:
        self.key_id = key

    def stored_len(self, payload_len: int) -> int:
        return payload_len

    def encode(self, payload: memoryview, aad: bytes) -> memoryview:
        return memoryview(bytes(b ^ self.key_id for b in bytes(payload)))

    def decode(self, stored: memoryview, aad: bytes, out: memoryview, key_id: int) -> bool:
        if key_id != self.key_id or stored.nbytes != out.nbytes:
            return False
        out[:] = bytes(b ^ self.key_id for b in bytes(stored))
        return True


def test_a_block_written_by_one_replica_is_read_by_another(tiers, redis_server):
    a, b = tiers(), tiers()
    assert a.write_many(blocks(1, 2, 3)) == [True] * 3
    assert a.contains(1) and a.stats().writes == 3
    wait_until(lambda: all(b.contains(h) for h in (1, 2, 3)), timeout=5)  # learned from the journal
    got = outs(1, 2, 3, 4)
    assert b.read_many(got) == [True, True, True, False]
    for (h, data), (_, want) in zip(got[:3], blocks(1, 2, 3), strict=True):
        assert bytes(data) == want, h
    s = b.stats()
    assert s.learned == 3 and s.read_bytes == 3 * STORED and s.misses == 1 and s.expired == 1
    # stored as the disk tier's block format, under the fingerprint, with a TTL
    r = redis.Redis.from_url(redis_server.url)
    raw = r.get(a.key(2))
    header = blk.decode_header(raw[: blk.HEADER_LEN])
    assert (header.fingerprint, header.block_hash, header.payload_len) == (FP, 2, BLOCK)
    assert a.key(2) == f"tgkv:{FP}:{2:064x}" and 0 < r.pttl(a.key(2)) <= 3600 * 1000


def test_another_fingerprint_never_sees_the_blocks(tiers):
    a, other = tiers(), tiers(fp="fedcba9876543210")
    a.write_many(blocks(5))
    time.sleep(0.1)
    assert not other.contains(5) and other.read_many(outs(5)) == [False]


def test_blocks_expire_with_their_ttl_on_both_sides(tiers, redis_server):
    a = tiers(ttl_s=0.4)
    a.write_many(blocks(1))
    assert a.contains(1)
    wait_until(lambda: not a.contains(1), timeout=5)
    assert redis.Redis.from_url(redis_server.url).exists(a.key(1)) == 0


def test_a_block_gone_from_redis_is_a_counted_miss_and_leaves_the_index(tiers, redis_server):
    a = tiers()
    a.write_many(blocks(1, 2))
    redis.Redis.from_url(redis_server.url).delete(a.key(1))  # as maxmemory eviction would
    assert a.contains(1)  # the index cannot know; the load confirms
    assert a.read_many(outs(1, 2)) == [False, True]
    assert not a.contains(1) and a.stats().expired == 1


def test_a_corrupt_block_is_deleted_and_an_undecodable_one_kept(tiers, redis_server):
    r = redis.Redis.from_url(redis_server.url)
    a = tiers()
    a.write_many(blocks(1))
    raw = bytearray(r.get(a.key(1)))
    raw[-1] ^= 0xFF
    r.set(a.key(1), bytes(raw))
    assert a.read_many(outs(1)) == [False]
    assert a.stats().corrupt == 1 and r.exists(a.key(1)) == 0

    sealed, reader, wrong_key = tiers(codec=XorCodec(0x5A)), tiers(), tiers(codec=XorCodec(0x33))
    sealed.write_many(blocks(9))
    stored = r.get(sealed.key(9))[blk.HEADER_LEN :]
    assert stored != blocks(9)[0][1]  # the codec's bytes, not the payload, went to Redis
    other = tiers(codec=XorCodec(0x5A))
    wait_until(lambda: other.contains(9) and reader.contains(9) and wrong_key.contains(9))
    got = outs(9)
    assert other.read_many(got) == [True] and bytes(got[0][1]) == blocks(9)[0][1]
    assert reader.read_many(outs(9)) == [False] and wrong_key.read_many(outs(9)) == [False]
    assert reader.stats().undecodable == 1 and wrong_key.stats().undecodable == 1
    assert r.exists(sealed.key(9)) == 1  # kept for a reader with the right key


def test_the_budget_deletes_least_recently_used_blocks_for_every_replica(tiers, redis_server):
    a, b = tiers(capacity=4 * STORED), tiers(capacity=4 * STORED)
    a.write_many(blocks(1, 2, 3, 4))
    a.read_many(outs(1))  # 1 was used: 2 is now the oldest
    wait_until(lambda: len(b.index) == 4)
    assert a.write_many(blocks(5, 6)) == [True, True]
    r = redis.Redis.from_url(redis_server.url)
    assert [r.exists(a.key(h)) for h in (1, 2, 3, 4, 5, 6)] == [1, 0, 0, 1, 1, 1]
    assert a.stats().evictions == 2 and a.stats().used_bytes == 4 * STORED
    wait_until(lambda: not b.contains(2) and not b.contains(3) and b.contains(6))
    assert b.stats().forgotten == 2
    # a job larger than the whole budget: the leading blocks are written, the tail refused
    assert a.write_many(blocks(*range(10, 16))) == [True] * 4 + [False] * 2
    assert a.stats().rejected_writes == 2


def test_an_older_journal_entry_does_not_bring_back_a_block_the_budget_deleted(tiers, monkeypatch):
    a = tiers(capacity=4 * STORED, refresh_s=60)  # the test takes the refresh thread's turns
    a.write_many(blocks(1, 2, 3, 4))  # journal: put 1..4, not yet read back by `a`
    announce = a.index.announce

    def refresh_first(puts, dels):  # the refresh reads the old entry mid-write
        a.index.refresh()
        return announce(puts, dels)

    monkeypatch.setattr(a.index, "announce", refresh_first)
    assert a.write_many(blocks(5, 6)) == [True, True]
    assert not a.contains(1) and not a.contains(2) and a.stats().used_bytes == 4 * STORED
    a.index.refresh()  # the deletion's own entry: nothing changes
    assert sorted(h for h in range(1, 7) if a.contains(h)) == [3, 4, 5, 6]
    assert a.write_many(blocks(1)) == [True] and a.contains(1)  # deleted blocks can come back


def test_a_replica_started_later_reads_the_whole_journal(tiers):
    a = tiers()
    a.write_many(blocks(1, 2))
    a.write_many(blocks(3))
    late = tiers(refresh_s=60)  # only the refresh at start
    assert all(late.contains(h) for h in (1, 2, 3)) and late.stats().learned == 3


def test_a_read_inside_a_decode_step_is_refused_and_counted(tiers):
    a = tiers()
    a.write_many(blocks(1))
    with decode_guard(), pytest.raises(ColdContractViolation, match="remote"):
        a.read_many(outs(1))
    assert a.stats().reads_in_decode == 1


def test_redis_down_at_start_then_up(tiers):
    """Counted, not timed: the breaker (its clock pinned, so no probe comes early) opens
    after three refusals, and every read and write after that is refused with no call to
    Redis at all (a spy on the client's own calls)."""
    port = free_port()
    clock = [1000.0]
    breakers = BreakerSet(clock=lambda: clock[0])
    t = RemoteTier(f"redis://127.0.0.1:{port}/0", FP, BLOCK, 64 * STORED, refresh_s=0.02, timeout_ms=20,
                   breakers=breakers)
    try:
        assert not t.healthy and "refused" in t.reason.lower()  # degraded from the first moment
        sent: list[str] = []
        for name in ("execute_command", "pipeline"):
            real = getattr(t.client, name)
            setattr(t.client, name, lambda *a, _real=real, _name=name, **kw: sent.append(_name) or _real(*a, **kw))
        for h in range(20):
            assert t.write_many(blocks(h)) == [False]
            assert t.read_many(outs(h)) == [False]
        s = t.stats()
        assert s.breaker_opened == 1 and s.errors == 3 and not t.writes_enabled  # three refusals open it
        assert len(sent) <= 3 and s.unavailable >= 40 - 3  # then refused at once: no round trip
        before = len(sent)
        for h in range(20):
            assert t.read_many(outs(h)) == [False]
        assert len(sent) == before and t.stats().unavailable == s.unavailable + 20
        with RedisServer(port):
            clock[0] += breakers[f"127.0.0.1:{port}"].max_open_s  # the cool-down is over: the refresh thread's probe may go
            wait_until(lambda: t.healthy, timeout=15)  # the probe closed it
            assert t.reason == "" and t.write_many(blocks(1)) == [True]
    finally:
        t.close()


def test_redis_killed_mid_run_then_restarted_empty(tiers, redis_server):
    a = tiers(timeout_ms=20)
    a.write_many(blocks(1, 2))
    redis_server.kill()  # SIGKILL
    assert a.read_many(outs(1, 2)) == [False, False]
    assert a.write_many(blocks(3)) == [False]
    wait_until(lambda: not a.healthy)
    assert "redis unreachable" in a.reason and a.contains(1)  # the index outlives the outage
    # a dead Redis is a refused or closed connection, answered at once, never a timeout waited out
    assert a.stats().errors >= 1 and "Timeout" not in a.reason, a.reason
    redis_server.start()  # same port, empty
    wait_until(lambda: a.healthy, timeout=15)
    assert a.stats().index_resets == 1 and not a.contains(1)  # a new run id: nothing is known
    assert a.write_many(blocks(3)) == [True]


def test_a_hung_redis_costs_one_timeout_not_a_hang(tiers, redis_server):
    """Counted, not timed: three reads time out and open the breaker; later reads are
    refused without a round trip, and lookups never send one (the client's own calls)."""
    a = tiers(timeout_ms=30, refresh_s=60)
    a.write_many(blocks(1))
    sent: list[str] = []
    for name in ("execute_command", "pipeline"):
        real = getattr(a.client, name)
        setattr(a.client, name, lambda *args, _real=real, _name=name, **kw: sent.append(_name) or _real(*args, **kw))
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(5):
            assert a.read_many(outs(1)) == [False]
        s = a.stats()
        assert s.errors == 3 and not a.healthy  # 3 timeouts open the breaker
        assert s.unavailable == 2 and len(sent) == 3  # then refused at once: no round trip
        assert all(a.contains(1) for _ in range(1000))  # lookups never wait on Redis
        assert len(sent) == 3
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)


def test_bad_settings_are_one_clear_error():
    with pytest.raises(TierguardError, match="bad url"):
        RemoteTier("http://example", FP, BLOCK, STORED)
    with pytest.raises(TierguardError, match="positive"):
        RemoteTier("redis://127.0.0.1:1/0", FP, BLOCK, STORED, ttl_s=0)


def test_an_error_reply_is_counted_but_does_not_mark_redis_down(tiers, redis_server):
    r = redis.Redis.from_url(redis_server.url)
    a = tiers()
    r.set(a.index.journal_key, b"not a stream")  # XRANGE/XADD now answer WRONGTYPE
    assert a.write_many(blocks(1)) == [True]  # the SETs of the pipeline still land
    wait_until(lambda: a.stats().errors > 0)  # the refresh's XRANGE failed
    assert a.healthy and a.writes_enabled and a.stats().breaker_opened == 0
    assert a.read_many(outs(1)) == [True]


def test_with_the_aes_codec_no_plaintext_run_reaches_redis(tiers, redis_server, tmp_path):
    """--kv-encrypt-key-file covers the remote tier: real AES-256-GCM through the same codec
    the disk tier uses; a replica with the key reads, one without it misses (counted)."""
    from tests.kv.test_kv_at_rest import key_file, kv_like, shares_a_run
    from tierguard.kv.media.aead_codec import AesGcmCodec

    tmp_path.chmod(0o700)
    codec = AesGcmCodec.from_files(key_file(tmp_path / "A"))
    plain_bytes = bytes(kv_like(3, BLOCK).numpy())
    sealed, same_key = tiers(codec=codec), tiers(codec=AesGcmCodec.from_files(str(tmp_path / "A")))
    other_key, clear = tiers(codec=AesGcmCodec.from_files(key_file(tmp_path / "B"))), tiers()
    assert sealed.write_many([(5, plain_bytes)]) and clear.write_many([(6, plain_bytes)])
    r = redis.Redis.from_url(redis_server.url)
    assert not shares_a_run(plain_bytes, r.get(sealed.key(5)))
    assert shares_a_run(plain_bytes, r.get(clear.key(6)))  # the check can fail
    wait_until(lambda: same_key.contains(5) and other_key.contains(5))
    got = outs(5)
    assert same_key.read_many(got) == [True] and bytes(got[0][1]) == plain_bytes
    assert other_key.read_many(outs(5)) == [False] and other_key.stats().undecodable == 1
