"""Block pool and block manager: states, LRU eviction, prefix matching, integrity."""

from __future__ import annotations

import pytest

from tierguard.engine.api import SamplingParams
from tierguard.engine.block_manager import BlockManager
from tierguard.engine.block_pool import BlockPool, BlockPoolExhausted
from tierguard.engine.prefix_hash import block_hash, prefix_block_hashes
from tierguard.engine.sequence import Sequence
from tierguard.kv.spec import KVLayout, fingerprint, fingerprint_salt


def seq(sid: str, tokens: list[int]) -> Sequence:
    return Sequence(sid, tokens, SamplingParams(), 0.0)


def test_pool_states_and_lru_eviction_records_evicted_hashes():
    pool = BlockPool(3, record_evictions=True)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.check_integrity()
    with pytest.raises(BlockPoolExhausted):
        pool.allocate()
    pool.register(a, 111, (1,))
    pool.register(b, 222, (2,))
    pool.release(b)  # cached, older
    pool.release(a)  # cached, newer
    pool.release(c)  # plain free
    assert (pool.num_free, pool.num_cached_free, pool.num_used) == (3, 2, 0)
    pool.check_integrity()
    assert pool.allocate() == c  # plain free blocks go first; nothing evicted
    assert pool.take_evicted() == []
    assert pool.allocate() == b  # then the least recently freed cached block
    assert pool.take_evicted() == [222] and pool.take_evicted() == []
    assert pool.lookup(222, (2,)) is None and pool.lookup(111, (1,)) == a
    pool.check_integrity()


def test_lookup_rejects_collisions_and_acquire_revives():
    pool = BlockPool(2)
    a = pool.allocate()
    pool.register(a, 5, (1, 2))
    assert pool.lookup(5, (1, 3)) is None  # same hash, other tokens
    pool.release(a)
    assert pool.is_cached_free(a)
    pool.acquire(a)
    assert pool.num_used == 1 and not pool.is_cached_free(a)
    pool.acquire(a)
    pool.release(a)
    pool.release(a)
    with pytest.raises(RuntimeError):
        pool.release(a)
    pool.check_integrity()


def test_duplicate_content_is_not_registered_twice():
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, 9, (1,))
    assert not pool.register(b, 9, (1,))
    pool.release(b)
    pool.release(a)
    assert pool.num_cached_free == 1
    pool.check_integrity()


def test_chained_hashes_depend_on_prefix_and_fingerprint():
    fp1 = fingerprint_salt(fingerprint("m", KVLayout(2, 2, 8, 4, "float32"), {"layers": 2}))
    fp2 = fingerprint_salt(fingerprint("m", KVLayout(2, 2, 8, 4, "bfloat16"), {"layers": 2}))
    tokens = list(range(12))
    h1 = prefix_block_hashes(tokens, 4, fp1)
    assert len(h1) == 3
    assert prefix_block_hashes(tokens, 4, fp2)[0] != h1[0]
    other = [99] + tokens[1:]
    assert prefix_block_hashes(other, 4, fp1)[2] != h1[2]  # same block, different prefix
    assert h1[1:] == prefix_block_hashes(tokens, 4, fp1, start=1, parent=h1[0])
    assert h1[1] == block_hash(h1[0], tokens[4:8])


def test_manager_prefix_match_never_covers_last_token():
    pool = BlockPool(8)
    bm = BlockManager(pool, 4, fingerprint=7)
    first = seq("a", list(range(8)))
    bm.admit(first, bm.lookup(first))
    assert bm.ensure_slots(first, 8)
    first.num_computed_tokens = 8
    bm.register_computed(first)
    bm.free(first)
    again = seq("b", list(range(8)))  # identical prompt: only block 0 may be reused
    match = bm.lookup(again)
    assert len(match.block_ids) == 1 and match.num_revived == 1 and match.missed_hashes == []
    fresh = seq("f", [50 + i for i in range(13)])
    assert bm.lookup(fresh).block_ids == [] and len(bm.lookup(fresh).missed_hashes) == 3
    longer = seq("c", list(range(9)))
    assert len(bm.lookup(longer).block_ids) == 2
    assert bm.can_admit(longer, bm.lookup(longer), 1)
    bm.admit(longer, bm.lookup(longer))
    assert longer.num_computed_tokens == 8
    assert bm.prefix_hits == 8 and bm.prefix_queries == 8 + 9
    bm.free(longer)
    pool.check_integrity()


def test_ensure_slots_is_all_or_nothing():
    pool = BlockPool(3)
    bm = BlockManager(pool, 4, fingerprint=1)
    s = seq("a", list(range(20)))
    assert not bm.ensure_slots(s, 13)  # needs 4 blocks
    assert s.block_table == [] and pool.num_free == 3
    assert bm.ensure_slots(s, 12)
    assert len(s.block_table) == 3
    pool.check_integrity()
