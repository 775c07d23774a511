"""The built-in transfer handlers: device <-> host RAM, and host RAM <-> any cold medium.

Device <-> host moves a whole job (one request's blocks) with `DevicePool.copy_blocks`:
one gather and one scatter per pool tensor, whatever the block ids, because a block is a
contiguous row on both sides (blocks-first layout, host slab rows). On CUDA the copy runs
on the worker thread's own stream; a device-to-host copy first waits for an event
recorded on the caller's stream at submit, so it sees every write the caller queued to
those blocks. The worker thread waits for its stream; the engine thread never does.

Host <-> cold medium hands the slots' bytes to the medium's `write_many`/`read_many`, so
checksums, codecs and file or network I/O all run on the worker's threads.
"""

from __future__ import annotations

import threading
from typing import cast

import torch

from tierguard.kv.media import ColdMedium, DeviceBlocks, HostSlots, KeyedBlocks
from tierguard.kv.media.host import HostTier
from tierguard.kv.spec import DevicePool
from tierguard.kv.transfer import TransferHandler, TransferSpec, TransferWorker


class DeviceHostCopy(TransferHandler):
    def __init__(self, pool: DevicePool, host: HostTier, to_device: bool) -> None:
        self.pool, self.host, self.to_device = pool, host, to_device
        self._cuda = pool.is_cuda
        self._local = threading.local()

    def prepare(self, spec: TransferSpec) -> object:
        if self._cuda and not self.to_device:
            ready = torch.cuda.Event()
            ready.record()
            return ready
        return None

    def run(self, spec: TransferSpec, prepared: object) -> list[bool]:
        # The worker routes by spec class, so the two sides are these types.
        device = cast(DeviceBlocks, spec.dst if self.to_device else spec.src)
        host = cast(HostSlots, spec.src if self.to_device else spec.dst)
        if not self._cuda:
            self.pool.copy_blocks(device.block_ids, self.host.slab, host.slots, self.to_device)
            return [True] * len(device)
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device=self.pool.tensors[0].device)
        with torch.cuda.stream(stream):
            if isinstance(prepared, torch.cuda.Event):
                stream.wait_event(prepared)
            self.pool.copy_blocks(
                device.block_ids, self.host.slab, host.slots, self.to_device, non_blocking=True
            )
            done = torch.cuda.Event()
            done.record()
        done.synchronize()  # this worker thread waits; the caller never does
        return [True] * len(device)


class HostToCold(TransferHandler):
    def __init__(self, host: HostTier, medium: ColdMedium) -> None:
        self.host, self.medium = host, medium

    def run(self, spec: TransferSpec, prepared: object) -> list[bool]:
        src, dst = cast(HostSlots, spec.src), cast(KeyedBlocks, spec.dst)
        items = [(h, self.host.slot_view(s)) for h, s in zip(dst.hashes, src.slots, strict=True)]
        return self.medium.write_many(items)


class ColdToHost(TransferHandler):
    def __init__(self, host: HostTier, medium: ColdMedium) -> None:
        self.host, self.medium = host, medium

    def run(self, spec: TransferSpec, prepared: object) -> list[bool]:
        src, dst = cast(KeyedBlocks, spec.src), cast(HostSlots, spec.dst)
        items = [(h, self.host.slot_view(s)) for h, s in zip(src.hashes, dst.slots, strict=True)]
        return self.medium.read_many(items)


def register_device_host(worker: TransferWorker, pool: DevicePool, host: HostTier) -> None:
    worker.register_handler(DeviceBlocks, HostSlots, DeviceHostCopy(pool, host, to_device=False))
    worker.register_handler(HostSlots, DeviceBlocks, DeviceHostCopy(pool, host, to_device=True))


def register_cold_medium(worker: TransferWorker, host: HostTier, medium: ColdMedium) -> None:
    """Routes host -> medium (write-behind) and medium -> host (staging); nothing else."""
    worker.register_handler(HostSlots, medium.spec, HostToCold(host, medium))
    worker.register_handler(medium.spec, HostSlots, ColdToHost(host, medium))
