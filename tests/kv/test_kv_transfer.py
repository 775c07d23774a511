from __future__ import annotations

import errno
import threading

import pytest
import torch

from tierguard.kv.copy_handlers import register_cold_medium, register_device_host
from tierguard.kv.faults import FaultInjector
from tierguard.kv.media import DeviceBlocks, HostSlots
from tierguard.kv.media.disk.tier import DiskBlocks, DiskTier
from tierguard.kv.media.host import HostTier
from tierguard.kv.spec import DevicePool, KVLayout
from tierguard.kv.transfer import TransferSpec, TransferWorker

from .conftest import FP, wait_until


def fill(pool: DevicePool, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def finished(worker: TransferWorker, n: int) -> dict:
    got: dict = {}
    wait_until(lambda: got.update({r.job_id: r for r in worker.get_finished()}) or len(got) >= n)
    return got


@pytest.mark.parametrize(
    "quant,dtype", [("none", "float16"), ("none", "bfloat16"), ("int8", "int8"), ("fp8", "float8_e4m3fn")]
)
def test_device_host_roundtrip_moves_exact_bytes(quant, dtype):
    layout = KVLayout(2, 2, 8, 4, dtype, quant)
    pool = DevicePool.allocate(layout, num_blocks=6)
    fill(pool)
    assert pool.block_bytes == layout.block_bytes
    host = HostTier(4 * layout.block_bytes, layout.block_bytes, pin_memory=False)
    worker = TransferWorker(layout.block_bytes)
    register_device_host(worker, pool, host)
    # one job per request: blocks 2 and 1 (out of order) into slots 3 and 0
    worker.transfer_async(1, TransferSpec(DeviceBlocks([2, 1]), HostSlots([3, 0])))
    assert finished(worker, 1)[1].success
    before = [t.clone() for t in pool.tensors]
    worker.transfer_async(2, TransferSpec(HostSlots([0, 3]), DeviceBlocks([4, 5])))
    r = finished(worker, 1)[2]
    assert r.success and r.block_ok == [True, True] and r.route == "host_to_device"
    for t, b in zip(pool.tensors, before, strict=True):
        assert torch.equal(t[4].view(torch.uint8), b[1].view(torch.uint8))
        assert torch.equal(t[5].view(torch.uint8), b[2].view(torch.uint8))
        assert torch.equal(t[0], b[0]) and torch.equal(t[3], b[3])  # untouched blocks unchanged
    # the host slot holds the block's payload exactly as payload_views lays it out
    for view, t in zip(pool.payload_views(host.slab[0]), pool.tensors, strict=True):
        assert torch.equal(view.view(torch.uint8), t[1].view(torch.uint8))
    stats = worker.route_stats()
    assert stats["device_to_host"].bytes == 2 * layout.block_bytes and stats["host_to_device"].jobs == 1
    assert worker.queue_depth == 0
    worker.shutdown()


def test_host_disk_roundtrip_and_missing_block(tmp_path, layout):
    host = HostTier(4 * layout.block_bytes, layout.block_bytes, pin_memory=False)
    disk = DiskTier(tmp_path, FP, 1 << 20)
    worker = TransferWorker(layout.block_bytes)
    register_cold_medium(worker, host, disk)
    host.slab[0].copy_(torch.arange(layout.block_bytes) % 251)
    worker.transfer_async(1, TransferSpec(HostSlots([0]), DiskBlocks([42])))
    assert finished(worker, 1)[1].success
    worker.transfer_async(2, TransferSpec(DiskBlocks([42, 43]), HostSlots([2, 3])))
    r = finished(worker, 1)[2]
    assert r.block_ok == [True, False] and not r.success
    assert torch.equal(host.slab[2], host.slab[0])
    worker.shutdown()


def test_injected_io_error_fails_the_job_not_the_caller(tmp_path, layout):
    faults = FaultInjector()
    host = HostTier(4 * layout.block_bytes, layout.block_bytes, pin_memory=False)
    worker = TransferWorker(layout.block_bytes, faults=faults)
    register_cold_medium(worker, host, DiskTier(tmp_path, FP, 1 << 20))
    faults.fail("transfer", errno.EIO)
    worker.transfer_async(1, TransferSpec(HostSlots([0]), DiskBlocks([1])))
    worker.transfer_async(2, TransferSpec(HostSlots([1]), DiskBlocks([2])))
    got = finished(worker, 2)
    assert sorted(r.success for r in got.values()) == [False, True]
    bad = next(r for r in got.values() if not r.success)
    assert "injected" in bad.error and bad.block_ok == [False]
    assert worker.route_stats()["host_to_disk"].failed_jobs == 1
    worker.shutdown()


def test_unsupported_routes_are_rejected_at_submit(layout):
    host = HostTier(4 * layout.block_bytes, layout.block_bytes, pin_memory=False)
    worker = TransferWorker(layout.block_bytes)
    register_device_host(worker, DevicePool.allocate(layout, 2), host)
    with pytest.raises(ValueError, match="disk_to_device"):
        worker.transfer_async(1, TransferSpec(DiskBlocks([1]), DeviceBlocks([0])))
    with pytest.raises(ValueError, match="host_to_disk"):
        worker.transfer_async(2, TransferSpec(HostSlots([0]), DiskBlocks([1])))  # no disk medium registered
    with pytest.raises(ValueError):
        TransferSpec(HostSlots([0, 1]), DeviceBlocks([0]))  # one target per block
    assert worker.queue_depth == 0
    worker.shutdown()


def test_submit_and_poll_never_wait_for_a_slow_transfer(tmp_path, layout):
    """Event ordering, not timing: the disk write cannot end until the test opens the gate,
    so submits and polls that returned before that did not wait for it (one that waited
    would never return: the thread below would still be alive at its hang guard)."""
    gate = threading.Event()
    entered = threading.Event()

    class SlowDisk(DiskTier):
        def write_many(self, items):
            entered.set()
            gate.wait(60)
            return super().write_many(items)

    host = HostTier(4 * layout.block_bytes, layout.block_bytes, pin_memory=False)
    worker = TransferWorker(layout.block_bytes, num_threads=1)
    register_cold_medium(worker, host, SlowDisk(tmp_path, FP, 1 << 20))
    polled: list = []

    def caller() -> None:
        for job in range(3):
            worker.transfer_async(job, TransferSpec(HostSlots([job]), DiskBlocks([job])))
        assert entered.wait(30)  # a job is inside the write, held there
        polled.append(worker.get_finished())

    t = threading.Thread(target=caller)
    t.start()
    t.join(30)  # a hang guard, not a bound
    assert not t.is_alive() and not gate.is_set()  # it returned while the write could not end
    assert polled == [[]] and worker.queue_depth == 3
    gate.set()
    assert all(r.success for r in finished(worker, 3).values())
    worker.shutdown()


def test_copy_blocks_moves_runs_and_lone_blocks_whole():
    layout = KVLayout(2, 2, 8, 4, "int8", "int8")  # two pool tensors: data and scales
    pool = DevicePool.allocate(layout, num_blocks=8)
    fill(pool)
    slab = torch.zeros(6, layout.block_bytes, dtype=torch.uint8)
    ids, slots = [2, 3, 4, 7, 0], [1, 2, 3, 0, 5]  # a run of three, then two lone blocks
    pool.copy_blocks(ids, slab, slots, to_device=False)
    for b, s in zip(ids, slots, strict=True):
        for view, t in zip(pool.payload_views(slab[s]), pool.tensors, strict=True):
            assert torch.equal(view.view(torch.uint8), t[b].view(torch.uint8))
    before = [t.clone() for t in pool.tensors]
    pool.copy_blocks([5, 6, 1], slab, [1, 2, 0], to_device=True)  # a run of two, then one
    for t, old in zip(pool.tensors, before, strict=True):
        assert torch.equal(t[5].view(torch.uint8), old[2].view(torch.uint8))
        assert torch.equal(t[6].view(torch.uint8), old[3].view(torch.uint8))
        assert torch.equal(t[1].view(torch.uint8), old[7].view(torch.uint8))
        assert torch.equal(t[0], old[0]) and torch.equal(t[4], old[4])


_NO_OMP_TEAM = """
import os, threading, torch
from concurrent.futures import ThreadPoolExecutor
from tierguard.kv.spec import DevicePool
torch.set_num_threads(2)
pool = DevicePool([torch.zeros((64, 32768), dtype=torch.float32)])  # 128 KiB blocks
slab = torch.zeros((64, pool.block_bytes), dtype=torch.uint8)
worker = ThreadPoolExecutor(1)
worker.submit(lambda: None).result()  # the transfer thread exists, idle
before = len(os.listdir("/proc/self/task"))
ids = list(range(64))
worker.submit(pool.copy_blocks, ids, slab, ids, False).result()  # 8 MiB, one run
worker.submit(pool.copy_blocks, ids, slab, ids, True).result()
print(len(os.listdir("/proc/self/task")) - before)
"""


def test_host_copies_start_no_openmp_team_on_the_transfer_thread():
    """A device <-> host copy on a CPU pool runs on the transfer thread alone: it leaves
    no second OpenMP team behind (more OpenMP threads than cores slow every later
    engine step, tier or no tier)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_OMP_TEAM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) == 0
