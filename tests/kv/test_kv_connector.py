"""End to end through the KV connector: offload, persist, restart, stage, load, faults, guard.

A real device pool, block pool, host tier, disk tier and transfer worker; the sequences
are plain records with the fields the connector reads.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from tierguard.common.stats import flat, quantile_ms
from tierguard.engine.block_manager import PrefixMatch
from tierguard.engine.block_pool import BlockPool
from tierguard.kv.connector import TierOptions
from tierguard.kv.contract import ColdContract
from tierguard.kv.faults import FaultInjector
from tierguard.kv.guard import ColdContractViolation, decode_depth, decode_guard
from tierguard.kv.media.disk import format as fmt
from tierguard.kv.spec import DevicePool, KVLayout
from tierguard.kv.tiered_connector import TieredConnector

from .conftest import wait_until

HASHES = [0x1111, 0x2222, 0x3333, 0x4444]


@dataclass
class Seq:
    seq_id: str
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    request_class: str = "interactive"


class Rig:
    """One engine's worth of tiers over a 16-block device pool."""

    def __init__(self, tmp_path, layout: KVLayout, fp: str, host_blocks: int = 8, faults=None, disk=True):
        self.layout = layout
        self.device = DevicePool.allocate(layout, num_blocks=16)
        self.pool = BlockPool(16, record_evictions=True)
        media = {"disk": {"dir": str(tmp_path), "capacity_bytes": 1 << 20}} if disk else {}
        options = TierOptions(host_blocks * layout.block_bytes, media)
        self.conn = TieredConnector.create(
            self.pool, self.device, layout.block_size, fp, options, ColdContract(), faults
        )

    def running_seq(self, name: str, hashes: list[int], seed: int = 0) -> Seq:
        """A sequence whose full blocks hold random KV under `hashes`."""
        bs = self.layout.block_size
        seq = Seq(name, list(range(len(hashes) * bs)), [self.pool.allocate() for _ in hashes], list(hashes))
        g = torch.Generator().manual_seed(seed)
        for b in seq.block_table:
            self.device.tensors[0][b] = torch.randn(self.device.tensors[0][b].shape, generator=g).to(
                self.device.tensors[0].dtype
            )
        return seq

    def finish(self, seq: Seq, preempted: bool = False) -> None:
        """What the scheduler does when a sequence leaves: offload, then free its blocks."""
        self.conn.offload(seq, preempted)
        for b in reversed(seq.block_table):
            self.pool.release(b)
        seq.block_table = []

    def persist_and_close(self, name: str, hashes: list[int]) -> Seq:
        """A finished sequence whose blocks went through host RAM to disk; then this rig
        stops (the tests that follow restart on the same disk)."""
        seq = self.running_seq(name, hashes)
        self.finish(seq)
        self.settle()
        self.conn.close()
        return seq

    def settle(self) -> list:
        done: list = []
        wait_until(lambda: done.extend(self.conn.poll().finished_loads) or not self.conn.busy())
        return done

    def load(self, seq: Seq, hashes: list[int]) -> bool:
        match = PrefixMatch(missed_hashes=list(hashes))
        _tokens, load_async = self.conn.get_num_matched(seq, match)
        return load_async and self.conn.start_load(seq, match)

    def loaded(self, seq: Seq, hashes: list[int]) -> list[int | None]:
        """Device block now holding each hash (published by the load), None if absent."""
        bs = self.layout.block_size
        return [
            self.pool.lookup(h, tuple(seq.token_ids[i * bs : (i + 1) * bs])) for i, h in enumerate(hashes)
        ]

    def stats(self) -> dict[str, float]:
        return flat(self.conn.stats(), prefix="kv_")

    def check(self) -> None:
        self.pool.check_integrity()
        self.conn.host.check_integrity()


def test_offload_then_load_from_host(tmp_path, layout, fp):
    rig = Rig(tmp_path, layout, fp, disk=False)
    a = rig.running_seq("a", HASHES[:3])
    expected = rig.device.tensors[0][a.block_table].clone()
    rig.finish(a)
    assert sum(rig.conn.held_refs().values()) == 3  # source blocks pinned until copied
    rig.settle()
    assert not rig.conn.held_refs()
    rig.pool.evict_all_cached()
    b = Seq("b", list(a.token_ids) + [7, 7, 7, 7])
    assert rig.load(b, HASHES)
    assert rig.conn.get_num_matched(b, PrefixMatch(missed_hashes=HASHES)) == (0, False)  # one look per stage
    assert rig.settle() == [b]
    blocks = rig.loaded(b, HASHES)
    assert blocks[3] is None and None not in blocks[:3]
    assert torch.equal(rig.device.tensors[0][blocks[:3]], expected)
    s = rig.stats()
    assert s["kv_host_hits"] == 3 and s["kv_tier_misses"] == 0 and s["kv_blocks_loaded"] == 3
    assert s["kv_offloaded_blocks"] == 3 and s["kv_transfer_device_to_host_jobs"] == 1  # one job per request
    rig.check()
    rig.conn.close()


def test_persisted_prefix_survives_restart_and_loads_from_disk(tmp_path, layout, fp):
    rig = Rig(tmp_path, layout, fp)
    a = rig.running_seq("a", HASHES, seed=3)
    expected = rig.device.tensors[0][a.block_table].clone()
    rig.finish(a)
    rig.settle()
    assert rig.stats()["kv_persisted_blocks"] == 4
    rig.conn.close()

    again = Rig(tmp_path, layout, fp)  # restart: empty host, same disk
    b = Seq("b", list(a.token_ids) + [1])
    assert again.load(b, HASHES)
    assert again.settle() == [b]
    assert torch.equal(again.device.tensors[0][again.loaded(b, HASHES)], expected)
    s = again.stats()
    assert s["kv_disk_hits"] == 4 and s["kv_blocks_loaded_from_disk"] == 4 and s["kv_host_bytes_used"] > 0
    again.check()
    again.conn.close()


def test_corrupt_block_on_disk_truncates_the_load(tmp_path, layout, fp):
    a = Rig(tmp_path, layout, fp).persist_and_close("a", HASHES)
    with open(os.path.join(tmp_path, fp, fmt.block_name(HASHES[2])), "r+b") as f:
        f.seek(fmt.HEADER_LEN + 5)
        f.write(b"\x00\x01\x02")
    again = Rig(tmp_path, layout, fp)
    b = Seq("b", list(a.token_ids) + [1])
    assert again.load(b, HASHES)
    assert again.settle() == [b]
    assert [x is not None for x in again.loaded(b, HASHES)] == [True, True, False, False]
    s = again.stats()
    assert s["kv_disk_corrupt"] == 1 and s["kv_stage_failures"] == 1 and s["kv_tier_misses"] == 2
    assert again.conn.host.contains(HASHES[3])  # staged fine; kept in RAM for later
    again.check()
    again.conn.close()


def test_transfer_fault_during_staging_is_a_miss(tmp_path, layout, fp):
    faults = FaultInjector()
    a = Rig(tmp_path, layout, fp, faults=faults).persist_and_close("a", HASHES[:2])
    again = Rig(tmp_path, layout, fp, faults=faults)
    faults.fail("transfer", errno.EIO)
    b = Seq("b", list(a.token_ids) + [1])
    assert again.load(b, HASHES[:2])
    assert again.settle() == [b]  # handed back: it recomputes
    assert again.loaded(b, HASHES[:2]) == [None, None] and again.pool.num_used == 0
    host = again.conn.host.stats()
    assert host.num_ready == 0 and host.num_pending == 0
    again.check()
    again.conn.close()


def test_disk_full_keeps_serving_from_host(tmp_path, layout, fp):
    faults = FaultInjector()
    rig = Rig(tmp_path, layout, fp, faults=faults)
    faults.fail("disk.write", errno.ENOSPC)
    a = rig.running_seq("a", HASHES[:2])
    rig.finish(a)
    rig.settle()
    s = rig.stats()
    assert s["kv_disk_healthy"] == 0.0 and s["kv_disk_write_errors"] == 1
    assert rig.conn.health() == {"disk": (False, rig.conn.media["disk"].reason)}
    rig.pool.evict_all_cached()
    b = Seq("b", list(a.token_ids) + [1])
    assert rig.load(b, HASHES[:2]) and rig.settle() == [b]
    assert None not in rig.loaded(b, HASHES[:2])
    rig.conn.close()


def test_aborted_load_releases_pins_and_device_blocks(tmp_path, layout, fp):
    faults = FaultInjector()
    a = Rig(tmp_path, layout, fp, faults=faults).persist_and_close("a", HASHES[:2])
    again = Rig(tmp_path, layout, fp, faults=faults)
    faults.delay("disk.read", 0.2)
    b = Seq("b", list(a.token_ids) + [1])
    assert again.load(b, HASHES[:2])
    assert sum(again.conn.held_refs().values()) == 2  # the load's target blocks
    again.conn.abort(b)
    assert sum(again.conn.held_refs().values()) == 2  # still pinned: the copy is in flight
    assert again.settle() == []  # never handed back
    assert not again.conn.held_refs() and again.pool.num_used == 0
    assert again.conn.host.reserve(0x9999) is not None  # nothing left pinned
    again.check()
    again.conn.close()


def test_staging_deadline_decides_per_class(tmp_path, layout, fp):
    faults = FaultInjector()
    a = Rig(tmp_path, layout, fp, faults=faults).persist_and_close("a", HASHES[:2])
    for cls, handed_back_early in (("interactive", True), ("batch", False)):
        again = Rig(tmp_path, layout, fp, faults=faults)
        again.conn.contract.budgets[cls] = 20.0  # staging gets 10 ms
        faults.delay("disk.read", 0.3)
        b = Seq("b", list(a.token_ids) + [1], request_class=cls)
        assert again.load(b, HASHES[:2])
        time.sleep(0.05)
        assert (again.conn.poll().finished_loads == [b]) is handed_back_early
        done = again.settle()
        s = again.stats()
        if handed_back_early:  # interactive recomputes; its abandoned copy still ends cleanly
            assert done == [] and s["kv_tier_recomputes"] == 1 and s["kv_contract_interactive_recompute"] == 1
        else:  # batch keeps waiting for its blocks
            assert done == [b] and s["kv_contract_batch_wait"] == 1 and s["kv_blocks_loaded_from_disk"] == 2
        assert not again.conn.held_refs()
        again.check()
        again.conn.close()


def test_engine_loop_under_decode_guard_never_reads_disk(tmp_path, layout, fp):
    """A fake engine: every step's decode part runs under decode_guard while staging of
    disk blocks proceeds on worker threads. The guard only trips on the decode thread."""
    rig = Rig(tmp_path, layout, fp, host_blocks=4)
    hashes = [0xA000 + i for i in range(12)]
    for i in range(0, 12, 4):  # persist 12 blocks through 4 host slots (host must evict)
        rig.finish(rig.running_seq(f"w{i}", hashes[i : i + 4]))
        rig.settle()
    disk = rig.conn.media["disk"]
    assert disk.stats().num_blocks == 12
    reads: list[tuple[int, int]] = []  # (thread, decode depth) of every read_many call
    read_many = disk.read_many

    def spy(items, *args, **kwargs):
        reads.append((threading.get_ident(), decode_depth()))
        return read_many(items, *args, **kwargs)

    disk.read_many = spy
    pending = {f"r{i}": Seq(f"r{i}", list(range(16)) + [i]) for i in range(3)}
    loaded: dict[str, int] = {}
    refused = 0
    deadline = time.monotonic() + 10
    while len(loaded) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)  # the "forward pass"
        if pending:  # admission stage: staging may begin here, outside decode
            rid, seq = next(iter(pending.items()))
            i = int(rid[1:])
            if rig.load(seq, hashes[4 * i : 4 * i + 4]):
                del pending[rid]
            else:  # every host slot pinned right now: a new stage retries
                rig.conn.abort(seq)
        with decode_guard():
            for seq in rig.conn.poll().finished_loads:  # polling is allowed in decode
                i = int(seq.seq_id[1:])
                loaded[seq.seq_id] = sum(b is not None for b in rig.loaded(seq, hashes[4 * i : 4 * i + 4]))
                for b in rig.loaded(seq, hashes[4 * i : 4 * i + 4]):
                    rig.pool.drop_cached(b)  # make room for the next load
            with pytest.raises(ColdContractViolation):
                disk.read(hashes[0])
            refused += 1
    assert loaded == {"r0": 4, "r1": 4, "r2": 4}
    assert disk.stats().reads_in_decode == refused  # only the decode thread's own attempts
    assert disk.stats().hits == 12  # every block was read
    engine = threading.get_ident()
    assert sum(1 for t, _ in reads if t == engine) == refused  # the engine thread only tried, in decode
    staged = [(t, d) for t, d in reads if t != engine]
    assert staged and all(d == 0 for _, d in staged)  # staging: worker threads, outside any guard
    rig.conn.close()


def test_naive_sync_disk_reads_inside_decode_and_counts_them(tmp_path, layout, fp):
    from tierguard.baselines.naive_kv import NaiveSpillTier, NaiveSyncDisk
    from tierguard.kv.media.disk.tier import DiskTier

    pool = DevicePool.allocate(layout, num_blocks=4)
    pool.tensors[0][0] = torch.randn(pool.tensors[0][0].shape).to(pool.tensors[0].dtype)
    with pytest.raises(ValueError):
        NaiveSyncDisk(pool, DiskTier(tmp_path / "strict", fp, 1 << 20))
    naive = NaiveSyncDisk(pool, NaiveSpillTier(tmp_path, fp, 1 << 20))
    assert naive.spill(0xBEEF, 0)
    with decode_guard():  # exactly what the contract forbids, done on purpose
        assert naive.restore(0xBEEF, 3)
        assert not naive.restore(0xDEAD, 2)
    assert torch.equal(pool.tensors[0][3], pool.tensors[0][0])
    assert naive.disk.stats().reads_in_decode == 2
    assert naive.counters.restores == 1 and naive.counters.restore_misses == 1 and naive.counters.stall_s > 0
    # the spilled block left the page cache, so the read inside decode went to the device
    assert naive.counters.dropped == 1 and naive.counters.drop_failures == 0


def test_quantile_ms_is_the_one_percentile_over_seconds():
    lat = [i / 1000 for i in range(100, 0, -1)]  # 100 .. 1 ms, in any order
    assert quantile_ms(lat, 0.5) == pytest.approx(50.5)
    assert quantile_ms(lat, 0.99) == pytest.approx(99.01)
    assert quantile_ms([0.002], 0.99) == pytest.approx(2.0)  # one sample: itself
    assert quantile_ms([], 0.99) == 0.0
