from __future__ import annotations

import random

from tierguard.kv.media.host import HostTier


def make(slots: int = 4, block_bytes: int = 64) -> HostTier:
    return HostTier(capacity_bytes=slots * block_bytes, block_bytes=block_bytes, pin_memory=False)


def store(tier: HostTier, h: int) -> int:
    r = tier.reserve(h)
    assert r is not None
    tier.finish_write(h, True)
    return r.slot


def test_budget_is_a_fixed_number_of_slots():
    tier = HostTier(capacity_bytes=1000, block_bytes=64, pin_memory=False)
    assert tier.num_slots == 15 and tier.capacity_bytes == 960
    for h in range(40):
        store(tier, h)
    st = tier.stats()
    assert st.used_bytes <= st.capacity_bytes and st.num_ready == 15 and st.evictions == 25
    tier.check_integrity()


def test_lru_evicts_least_recently_used():
    tier = make(slots=3)
    for h in (1, 2, 3):
        store(tier, h)
    slot = tier.begin_read(1)  # touch 1: now 2 is the oldest
    assert slot is not None
    tier.finish_read(1)
    r = tier.reserve(4)
    assert r is not None and r.evicted == [2]
    tier.finish_write(4, True)
    assert tier.contains(1) and not tier.contains(2) and tier.contains(3) and tier.contains(4)
    tier.check_integrity()


def test_pending_block_is_not_loadable_until_write_completes():
    tier = make()
    r = tier.reserve(7)
    assert r is not None
    assert not tier.contains(7) and tier.is_present(7)
    assert tier.begin_read(7) is None
    assert tier.reserve(7) is None  # no double store
    tier.finish_write(7, True)
    assert tier.contains(7)


def test_failed_write_frees_the_slot():
    tier = make(slots=1)
    tier.reserve(1)
    tier.finish_write(1, False)
    assert not tier.is_present(1)
    assert tier.reserve(2) is not None
    tier.check_integrity()


def test_pinned_blocks_are_never_evicted():
    tier = make(slots=2)
    store(tier, 1)
    store(tier, 2)
    tier.begin_read(1)
    tier.begin_read(2)
    assert tier.reserve(3) is None  # every slot pinned: refuse rather than evict
    tier.finish_read(2)
    r = tier.reserve(3)
    assert r is not None and r.evicted == [2]
    assert tier.contains(1)
    tier.check_integrity()


def test_keep_pinned_hands_the_write_reference_to_a_reader():
    tier = make(slots=1)
    tier.reserve(1)
    tier.finish_write(1, True, keep_pinned=True)
    assert tier.contains(1) and tier.reserve(2) is None  # still pinned
    tier.finish_read(1)
    assert tier.reserve(2) is not None


def test_random_operations_keep_integrity():
    rng = random.Random(0)
    tier = make(slots=5)
    reading: list[int] = []
    pending: list[int] = []
    for _ in range(2000):
        op = rng.random()
        h = rng.randrange(20)
        if op < 0.4:
            if tier.reserve(h) is not None:
                pending.append(h)
        elif op < 0.6 and pending:
            tier.finish_write(pending.pop(rng.randrange(len(pending))), rng.random() < 0.8)
        elif op < 0.8:
            if tier.begin_read(h) is not None:
                reading.append(h)
        elif reading:
            tier.finish_read(reading.pop(rng.randrange(len(reading))))
        tier.check_integrity()
