"""`--kv-naive-sync-disk`: the failure mode the contract exists to prevent, for benchmarks only.

NVMe used as an extension of VRAM: when the device pool runs short, blocks of *running*
sequences are written to disk, and read back synchronously inside the step that needs
them. Every call here blocks the calling (engine) thread on disk I/O. The files live in a
spill tier of their own (`NaiveSpillTier`, same file format and checksums as the disk
tier, under `<disk dir>/naive-spill/`) whose only difference is that a read from inside a
decode step is counted (`reads_in_decode`) instead of refused: the production disk tier
has no such switch. The stall time is counted here, so a benchmark can put the cost next
to the contract's numbers.

Device latency, not page-cache latency: on a real box the spilled blocks of a long
session live on the NVMe, so the synchronous read inside decode waits for the device.
Right after a block is written (and fdatasync'ed by the disk tier) its pages are
dropped from the page cache (`posix_fadvise(DONTNEED)`), so the read-back goes to the
device here too instead of being served from RAM at memcpy speed. Where the hint is not
supported the read may still hit the cache; `dropped` / `drop_failures` say which
happened. The contract path does not do this: its staging reads are asynchronous and
are allowed to be served from the page cache.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from tierguard.kv.guard import decode_in_progress
from tierguard.kv.media.disk import format as fmt
from tierguard.kv.media.disk.tier import DiskTier
from tierguard.kv.spec import DevicePool


class NaiveSpillTier(DiskTier):
    """A disk tier that lets the decode thread read (benchmark only), counting each read."""

    def _check_guard(self, n: int) -> None:
        if decode_in_progress():
            with self._lock:
                self._c["reads_in_decode"] += n


@dataclass
class NaiveCounters:
    spills: int = 0
    restores: int = 0
    restore_misses: int = 0
    stall_s: float = 0.0  # time the engine thread spent blocked in here
    dropped: int = 0  # spilled blocks whose cached pages were dropped (reads go to the device)
    drop_failures: int = 0


class NaiveSyncDisk:
    def __init__(self, pool: DevicePool, disk: DiskTier) -> None:
        if not isinstance(disk, NaiveSpillTier):
            raise ValueError("naive sync disk mode needs its own NaiveSpillTier (reads inside decode)")
        self.pool = pool
        self.disk = disk
        self._bounce = torch.empty(pool.block_bytes, dtype=torch.uint8)
        self.counters = NaiveCounters()

    def spill(self, block_hash: int, device_block: int) -> bool:
        """Copy one device block to disk now (blocking); False if the disk refused it."""
        t0 = time.perf_counter()
        # Synchronous on CUDA too: that is the point.
        self.pool.copy_blocks([device_block], self._bounce.view(1, -1), [0], to_device=False)
        ok = self.disk.write(block_hash, self._bounce)
        if ok:
            self._drop_from_page_cache(block_hash)
        self.counters.spills += 1
        self.counters.stall_s += time.perf_counter() - t0
        return ok

    def restore(self, block_hash: int, device_block: int) -> bool:
        """Read one block from disk into the device pool now (blocking); False on a miss."""
        t0 = time.perf_counter()
        ok = self.disk.read_into(block_hash, self._bounce)
        if ok:
            self.pool.copy_blocks([device_block], self._bounce.view(1, -1), [0], to_device=True)
            self.counters.restores += 1
        else:
            self.counters.restore_misses += 1
        self.counters.stall_s += time.perf_counter() - t0
        return ok

    def _drop_from_page_cache(self, block_hash: int) -> None:
        """Evict the block file's (clean, synced) pages so the next read waits for the device."""
        path = os.path.join(self.disk.root, self.disk.fingerprint, fmt.block_name(block_hash))
        try:
            fd = os.open(path, os.O_RDONLY | fmt.OPEN_FLAGS)
        except OSError:
            self.counters.drop_failures += 1
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self.counters.dropped += 1
        except (OSError, AttributeError):  # no fadvise here: the read may hit the page cache
            self.counters.drop_failures += 1
        finally:
            os.close(fd)
