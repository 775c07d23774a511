"""End to end through KVTierStore: offload, persist, restart, stage, load, faults, decode guard."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from tierguard.kv import disk_format as fmt
from tierguard.kv.faults import FaultInjector
from tierguard.kv.guard import ColdContractViolation, decode_guard
from tierguard.kv.spec import DevicePool, KVLayout
from tierguard.kv.store import KVTierStore, PollResult, quantile_ms

from .conftest import wait_until

HASHES = [0x1111, 0x2222, 0x3333, 0x4444]


def make_store(tmp_path, layout: KVLayout, fp: str, host_blocks: int = 8, faults=None, **kw):
    pool = DevicePool.allocate(layout, num_blocks=16)
    store = KVTierStore.create(
        pool, fp, host_blocks * layout.block_bytes, str(tmp_path), 1 << 20, faults=faults, **kw
    )
    return pool, store


def fill_blocks(pool: DevicePool, blocks: list[int], seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in blocks:
        pool.tensors[0][:, :, b] = torch.randn(pool.tensors[0][:, :, b].shape, generator=g).to(
            pool.tensors[0].dtype
        )


def drain(store: KVTierStore, until) -> PollResult:
    acc = PollResult()

    def step() -> bool:
        r = store.poll()
        acc.loads_done += r.loads_done
        acc.released_blocks += r.released_blocks
        return until(acc)

    wait_until(step)
    return acc


def settle(store: KVTierStore) -> None:
    drain(store, lambda _acc: store.worker.queue_depth == 0 and not store._jobs)


def test_offload_then_load_from_host(tmp_path, layout, fp):
    pool, store = make_store(tmp_path, layout, fp)
    fill_blocks(pool, [0, 1, 2])
    busy = store.offload(HASHES[:3], [0, 1, 2])
    assert sorted(busy) == [0, 1, 2]
    res = drain(store, lambda acc: sorted(acc.released_blocks) == [0, 1, 2])
    assert res.released_blocks
    assert store.lookup(HASHES).num_host == 3
    assert store.start_load("r1", HASHES, [8, 9, 10, 11]) == 3
    done = drain(store, lambda acc: bool(acc.loads_done)).loads_done[0]
    assert (done.request_id, done.num_blocks, done.from_disk) == ("r1", 3, 0)
    assert torch.equal(pool.tensors[0][:, :, 8:11], pool.tensors[0][:, :, 0:3])
    store.manager.host.check_integrity()
    assert store.manager.counters.host_hits == 3 and store.manager.counters.misses == 1
    store.shutdown()


def test_persisted_prefix_survives_restart_and_loads_from_disk(tmp_path, layout, fp):
    pool, store = make_store(tmp_path, layout, fp)
    fill_blocks(pool, [0, 1, 2, 3], seed=3)
    store.offload(HASHES, [0, 1, 2, 3], persist=True)
    wait_until(lambda: (store.poll() and False) or store.disk.stats().num_blocks == 4)
    settle(store)
    expected = pool.tensors[0][:, :, 0:4].clone()
    store.shutdown()

    pool2, store2 = make_store(tmp_path, layout, fp)  # restart: empty host, same disk
    assert store2.lookup(HASHES).num_host == 0 and store2.lookup(HASHES).num_available == 4
    assert store2.start_load("r", HASHES, [4, 5, 6, 7]) == 4
    done = drain(store2, lambda acc: bool(acc.loads_done)).loads_done[0]
    assert done.num_blocks == 4 and done.from_disk == 4
    assert torch.equal(pool2.tensors[0][:, :, 4:8], expected)
    assert store2.stats()["kv_disk_hits"] == 4 and store2.stats()["kv_host_bytes_used"] > 0
    store2.manager.host.check_integrity()
    store2.shutdown()


def test_corrupt_block_on_disk_truncates_the_load(tmp_path, layout, fp):
    pool, store = make_store(tmp_path, layout, fp)
    fill_blocks(pool, [0, 1, 2, 3])
    store.offload(HASHES, [0, 1, 2, 3], persist=True)
    wait_until(lambda: (store.poll() and False) or store.disk.stats().num_blocks == 4)
    settle(store)
    store.shutdown()
    with open(os.path.join(tmp_path, fp, fmt.block_name(HASHES[2])), "r+b") as f:
        f.seek(fmt.HEADER_LEN + 5)
        f.write(b"\x00\x01\x02")
    pool2, store2 = make_store(tmp_path, layout, fp)
    store2.start_load("r", HASHES, [4, 5, 6, 7])
    done = drain(store2, lambda acc: bool(acc.loads_done)).loads_done[0]
    assert done.num_blocks == 2  # blocks 0,1 loaded; 2 corrupt -> 2 and 3 recompute
    s = store2.stats()
    assert s["kv_disk_corrupt"] == 1 and s["kv_stage_failures"] == 1 and s["kv_tier_misses"] == 2
    assert store2.manager.host.contains(HASHES[3])  # staged fine; kept in RAM for later
    store2.manager.host.check_integrity()
    store2.shutdown()


def test_transfer_fault_during_staging_is_a_miss(tmp_path, layout, fp):
    faults = FaultInjector()
    pool, store = make_store(tmp_path, layout, fp, faults=faults)
    store.offload(HASHES[:2], [0, 1], persist=True)
    wait_until(lambda: (store.poll() and False) or store.disk.stats().num_blocks == 2)
    settle(store)
    store.shutdown()
    pool2, store2 = make_store(tmp_path, layout, fp, faults=faults)
    faults.fail("transfer", errno.EIO)
    store2.start_load("r", HASHES[:2], [4, 5])
    done = drain(store2, lambda acc: bool(acc.loads_done)).loads_done[0]
    assert done.num_blocks == 0
    store2.manager.host.check_integrity()
    assert store2.manager.host.stats().num_ready == 0 and store2.manager.host.stats().num_pending == 0
    store2.shutdown()


def test_disk_full_keeps_serving_from_host(tmp_path, layout, fp):
    faults = FaultInjector()
    pool, store = make_store(tmp_path, layout, fp, faults=faults)
    faults.fail("disk.write", errno.ENOSPC)
    fill_blocks(pool, [0, 1])
    store.offload(HASHES[:2], [0, 1], persist=True)
    settle(store)
    s = store.stats()
    assert s["kv_disk_healthy"] == 0.0 and s["kv_disk_write_errors"] == 1
    store.start_load("r", HASHES[:2], [4, 5])
    assert drain(store, lambda acc: bool(acc.loads_done)).loads_done[0].num_blocks == 2
    store.shutdown()


def test_abandoned_load_releases_pins_and_device_blocks(tmp_path, layout, fp):
    pool, store = make_store(tmp_path, layout, fp)
    store.offload(HASHES[:2], [0, 1], persist=True)
    wait_until(lambda: (store.poll() and False) or store.disk.stats().num_blocks == 2)
    settle(store)
    store.shutdown()
    pool2, store2 = make_store(tmp_path, layout, fp)
    store2.start_load("r", HASHES[:2], [4, 5])
    store2.abandon("r")
    res = drain(store2, lambda acc: sorted(acc.released_blocks) == [4, 5])
    assert res.loads_done == []
    settle(store2)
    store2.manager.host.check_integrity()
    assert store2.manager.host.stats().num_pending == 0
    assert store2.manager.host.reserve(0x9999) is not None  # nothing left pinned
    store2.shutdown()


def test_engine_loop_under_decode_guard_never_reads_disk(tmp_path, layout, fp):
    """A fake engine: every step's decode part runs under decode_guard while staging of
    disk blocks proceeds on worker threads. The guard only trips on the decode thread."""
    pool, store = make_store(tmp_path, layout, fp, host_blocks=4)
    hashes = [0xA000 + i for i in range(12)]
    for i in range(0, 12, 4):  # persist 12 blocks through 4 host slots (host must evict)
        store.offload(hashes[i : i + 4], [0, 1, 2, 3], persist=True)
        settle(store)
    assert store.disk.stats().num_blocks == 12
    pending = {f"r{i}": hashes[i * 4 : i * 4 + 4] for i in range(3)}
    loaded: dict[str, int] = {}
    deadline = time.monotonic() + 10
    while len(loaded) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)  # the "forward pass"
        if pending:  # admission stage: staging may begin here, outside decode
            rid, hs = next(iter(pending.items()))
            base = 4 + 4 * int(rid[1:])
            if store.start_load(rid, hs, list(range(base, base + 4))):
                del pending[rid]  # else every host slot is pinned: retry next step
        with decode_guard():
            for d in store.poll().loads_done:  # polling and lookups are allowed in decode
                loaded[d.request_id] = d.num_blocks
            store.lookup(hashes)
            with pytest.raises(ColdContractViolation):
                store.disk.read(hashes[0])
    assert loaded == {"r0": 4, "r1": 4, "r2": 4}
    assert store.disk.stats().reads_in_decode == 0
    store.shutdown()


def test_naive_sync_disk_reads_inside_decode_and_counts_them(tmp_path, layout, fp):
    from tierguard.kv.disk_tier import DiskTier
    from tierguard.kv.naive import NaiveSyncDisk

    pool = DevicePool.allocate(layout, num_blocks=4)
    fill_blocks(pool, [0], seed=7)
    with pytest.raises(ValueError):
        NaiveSyncDisk(pool, DiskTier(tmp_path / "strict", fp, 1 << 20))
    naive = NaiveSyncDisk(pool, DiskTier(tmp_path, fp, 1 << 20, allow_reads_in_decode=True))
    assert naive.spill(0xBEEF, 0)
    with decode_guard():  # exactly what the contract forbids, done on purpose
        assert naive.restore(0xBEEF, 3)
        assert not naive.restore(0xDEAD, 2)
    assert torch.equal(pool.tensors[0][:, :, 3], pool.tensors[0][:, :, 0])
    assert naive.disk.stats().reads_in_decode == 2
    assert naive.counters.restores == 1 and naive.counters.restore_misses == 1 and naive.counters.stall_s > 0
    # the spilled block left the page cache, so the read inside decode went to the device
    assert naive.counters.dropped == 1 and naive.counters.drop_failures == 0


def test_quantile_ms_is_nearest_rank_over_sorted_seconds():
    lat = [i / 1000 for i in range(1, 101)]  # 1 .. 100 ms, ascending
    assert quantile_ms(lat, 0.5) == pytest.approx(51.0)
    assert quantile_ms(lat, 0.99) == pytest.approx(100.0)
    assert quantile_ms([0.002], 0.99) == pytest.approx(2.0)  # one sample: itself
    assert quantile_ms([], 0.99) == 0.0
