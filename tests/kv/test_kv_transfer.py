from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

from tierguard.kv.disk_tier import DiskTier
from tierguard.kv.faults import FaultInjector
from tierguard.kv.host_tier import HostTier
from tierguard.kv.spec import DevicePool, KVLayout, Medium
from tierguard.kv.transfer import BlockTransfer, TransferSpec, TransferWorker

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
    worker = TransferWorker(host, pool=pool)
    worker.transfer_async(
        1, TransferSpec(Medium.DEVICE, Medium.HOST, [BlockTransfer(10, 0, 1), BlockTransfer(11, 1, 2)])
    )
    assert finished(worker, 1)[1].success
    before = [t.clone() for t in pool.tensors]
    worker.transfer_async(
        2, TransferSpec(Medium.HOST, Medium.DEVICE, [BlockTransfer(10, 0, 4), BlockTransfer(11, 1, 5)])
    )
    r = finished(worker, 1)[2]
    assert r.success and r.block_ok == [True, True] and r.route == (Medium.HOST, Medium.DEVICE)
    for t, b in zip(pool.tensors, before, strict=True):
        assert torch.equal(t[:, :, 4].view(torch.uint8), b[:, :, 1].view(torch.uint8))
        assert torch.equal(t[:, :, 5].view(torch.uint8), b[:, :, 2].view(torch.uint8))
        assert torch.equal(t[:, :, 0], b[:, :, 0])  # untouched blocks unchanged
    assert worker.queue_depth == 0
    worker.shutdown()


def test_host_disk_roundtrip_and_missing_block(tmp_path, layout):
    host = HostTier(4 * layout.block_bytes, layout.block_bytes, pin_memory=False)
    disk = DiskTier(tmp_path, FP, 1 << 20)
    worker = TransferWorker(host, disk=disk)
    host.slab[0].copy_(torch.arange(layout.block_bytes) % 251)
    worker.transfer_async(1, TransferSpec(Medium.HOST, Medium.DISK, [BlockTransfer(42, 0)]))
    assert finished(worker, 1)[1].success
    worker.transfer_async(
        2, TransferSpec(Medium.DISK, Medium.HOST, [BlockTransfer(42, 2), BlockTransfer(43, 3)])
    )
    r = finished(worker, 1)[2]
    assert r.block_ok == [True, False] and not r.success
    assert torch.equal(host.slab[2], host.slab[0])
    worker.shutdown()


def test_injected_io_error_fails_the_job_not_the_caller(tmp_path, layout):
    faults = FaultInjector()
    host = HostTier(4 * layout.block_bytes, layout.block_bytes, pin_memory=False)
    worker = TransferWorker(host, disk=DiskTier(tmp_path, FP, 1 << 20), faults=faults)
    faults.fail("transfer", errno.EIO)
    worker.transfer_async(1, TransferSpec(Medium.HOST, Medium.DISK, [BlockTransfer(1, 0)]))
    worker.transfer_async(2, TransferSpec(Medium.HOST, Medium.DISK, [BlockTransfer(2, 1)]))
    got = finished(worker, 2)
    assert sorted(r.success for r in got.values()) == [False, True]
    bad = next(r for r in got.values() if not r.success)
    assert "injected" in bad.error and bad.block_ok == [False]
    assert worker.route_stats[(Medium.HOST, Medium.DISK)].failed_jobs == 1
    worker.shutdown()


def test_unsupported_routes_are_rejected_at_submit(layout):
    host = HostTier(4 * layout.block_bytes, layout.block_bytes, pin_memory=False)
    worker = TransferWorker(host)
    with pytest.raises(ValueError):
        worker.transfer_async(1, TransferSpec(Medium.DISK, Medium.DEVICE, [BlockTransfer(1, 0, 0)]))
    with pytest.raises(ValueError):
        worker.transfer_async(
            2, TransferSpec(Medium.HOST, Medium.DISK, [BlockTransfer(1, 0)])
        )  # no disk tier
    worker.shutdown()


def test_submit_and_poll_never_wait_for_a_slow_transfer(tmp_path, layout):
    gate = threading.Event()

    class SlowDisk(DiskTier):
        def write_many(self, items):
            gate.wait(5)
            return super().write_many(items)

    host = HostTier(4 * layout.block_bytes, layout.block_bytes, pin_memory=False)
    worker = TransferWorker(host, disk=SlowDisk(tmp_path, FP, 1 << 20), num_threads=1)
    t0 = time.perf_counter()
    for job in range(3):
        worker.transfer_async(job, TransferSpec(Medium.HOST, Medium.DISK, [BlockTransfer(job, job)]))
    assert worker.get_finished() == []
    assert time.perf_counter() - t0 < 0.5 and worker.queue_depth == 3
    gate.set()
    assert all(r.success for r in finished(worker, 3).values())
    worker.shutdown()
