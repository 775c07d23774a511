"""Scheduler-side policy of the tiers, keyed by chained block hash (like vLLM's OffloadingManager).

The manager decides what to load, store and persist and keeps the two-phase bookkeeping;
the transfer worker moves the bytes. Every `prepare_*` pins what it returns (host slots
reserved or referenced) and the matching `complete_*` releases it, so a block being loaded
or stored is never evicted or reused mid-transfer.

Load path:   lookup -> prepare_load -> [DISK->HOST job, complete_stage] -> HOST->DEVICE job
             -> complete_load
Store path:  prepare_store -> DEVICE->HOST job -> complete_store
             -> (prefix blocks only) prepare_persist -> HOST->DISK job -> complete_persist

Invariants: a block whose store has not completed is not loadable (host entries stay
PENDING until `complete_store(success=True)`); lookups never do I/O and never modify
state, so the scheduler may call them inside a step; disk reads happen only in jobs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tierguard.kv.disk_tier import DiskTier
from tierguard.kv.host_tier import HostTier
from tierguard.kv.spec import Medium


@dataclass
class LookupResult:
    num_host: int  # leading blocks ready in host RAM
    num_available: int  # leading blocks ready in host RAM or on disk (>= num_host)


@dataclass
class LoadBlock:
    block_hash: int
    host_slot: int
    source: Medium  # HOST: already in RAM; DISK: must be staged into `host_slot` first


@dataclass
class PrepareLoadOutput:
    """The leading blocks that will be loaded, in order; the rest of the request recomputes."""

    blocks: list[LoadBlock]

    @property
    def to_stage(self) -> list[LoadBlock]:
        return [b for b in self.blocks if b.source is Medium.DISK]


@dataclass
class PrepareStoreOutput:
    to_store: list[tuple[int, int]]  # (block hash, reserved host slot), in order
    evicted: list[int] = field(default_factory=list)  # host blocks dropped to make room


@dataclass
class ManagerCounters:
    host_hits: int = 0  # blocks loaded from host RAM
    disk_hits: int = 0  # blocks staged from disk
    misses: int = 0  # requested blocks that had to be recomputed
    stage_failures: int = 0  # disk blocks that failed to stage (turned into misses)
    stores: int = 0
    store_failures: int = 0
    host_evictions: int = 0
    persisted: int = 0
    persist_failures: int = 0


class OffloadManager:
    def __init__(self, host: HostTier, disk: DiskTier | None = None) -> None:
        self.host = host
        self.disk = disk
        self.counters = ManagerCounters()
        self._lock = threading.Lock()  # guards counters only; the tiers lock themselves

    def _on_disk(self, block_hash: int) -> bool:
        return self.disk is not None and self.disk.contains(block_hash)

    def lookup(self, hashes: list[int]) -> LookupResult:
        """Count leading blocks available per tier. No I/O, no state change."""
        num_host = num_available = 0
        host_run = True
        for h in hashes:
            in_host = self.host.contains(h)
            if not (in_host or self._on_disk(h)):
                break
            num_available += 1
            host_run = host_run and in_host
            num_host += 1 if host_run else 0
        return LookupResult(num_host=num_host, num_available=num_available)

    def prepare_load(self, hashes: list[int]) -> PrepareLoadOutput:
        """Pin the leading loadable blocks: host ones for reading, disk ones get a host slot.

        Stops at the first block that is nowhere or for which no host slot can be reserved
        (every slot pinned). Counts hits per tier and the requested blocks left as misses.
        """
        blocks: list[LoadBlock] = []
        evicted = 0
        for h in hashes:
            slot = self.host.begin_read(h)
            if slot is not None:
                blocks.append(LoadBlock(h, slot, Medium.HOST))
                continue
            if not self._on_disk(h):
                break
            reservation = self.host.reserve(h)
            if reservation is None:
                break
            evicted += len(reservation.evicted)
            blocks.append(LoadBlock(h, reservation.slot, Medium.DISK))
        with self._lock:
            c = self.counters
            c.host_hits += sum(1 for b in blocks if b.source is Medium.HOST)
            c.disk_hits += sum(1 for b in blocks if b.source is Medium.DISK)
            c.misses += len(hashes) - len(blocks)
            c.host_evictions += evicted
        return PrepareLoadOutput(blocks)

    def complete_stage(self, blocks: list[LoadBlock], block_ok: list[bool]) -> int:
        """Publish staged disk blocks and return how many leading blocks stay loadable.

        A failed block (I/O error, bad checksum) frees its slot; it and every later block
        of the request are released here, since a chain cannot skip a block. The caller
        then loads only the returned prefix and calls `complete_load` on that prefix.
        """
        ok_by_hash = dict(
            zip((b.block_hash for b in blocks if b.source is Medium.DISK), block_ok, strict=True)
        )
        keep = 0
        failed = 0
        broken = False
        for b in blocks:
            good = not broken and (b.source is Medium.HOST or ok_by_hash[b.block_hash])
            if b.source is Medium.DISK:
                failed += 0 if ok_by_hash[b.block_hash] else 1
                self.host.finish_write(b.block_hash, ok_by_hash[b.block_hash], keep_pinned=good)
            elif not good:
                self.host.finish_read(b.block_hash)
            broken = broken or not good
            keep += 1 if good else 0
        with self._lock:
            self.counters.stage_failures += failed
            self.counters.misses += len(blocks) - keep
            self.counters.disk_hits -= failed
        return keep

    def complete_load(self, hashes: list[int]) -> None:
        """Unpin blocks whose HOST->DEVICE copy finished (successfully or not)."""
        for h in hashes:
            self.host.finish_read(h)

    def prepare_store(self, hashes: list[int]) -> PrepareStoreOutput:
        """Reserve host slots for blocks not already in host RAM (pending until completed)."""
        out = PrepareStoreOutput(to_store=[])
        for h in hashes:
            if self.host.is_present(h):
                continue
            reservation = self.host.reserve(h)
            if reservation is None:
                break  # every slot pinned: storing fewer blocks is always safe
            out.to_store.append((h, reservation.slot))
            out.evicted.extend(reservation.evicted)
        with self._lock:
            self.counters.host_evictions += len(out.evicted)
        return out

    def complete_store(self, hashes: list[int], success: bool) -> None:
        for h in hashes:
            self.host.finish_write(h, success)
        with self._lock:
            if success:
                self.counters.stores += len(hashes)
            else:
                self.counters.store_failures += len(hashes)

    def prepare_persist(self, hashes: list[int]) -> list[tuple[int, int]]:
        """Pin host-resident blocks that should also go to disk; [] when disk writes are off."""
        if self.disk is None or not self.disk.writes_enabled:
            return []
        out = []
        for h in hashes:
            if self.disk.contains(h):
                continue
            slot = self.host.begin_read(h)
            if slot is not None:
                out.append((h, slot))
        return out

    def complete_persist(self, hashes: list[int], block_ok: list[bool]) -> None:
        for h in hashes:
            self.host.finish_read(h)
        with self._lock:
            self.counters.persisted += sum(block_ok)
            self.counters.persist_failures += len(block_ok) - sum(block_ok)
