"""Scheduler-side policy of the tiers, keyed by chained block hash (vLLM's `OffloadingManager`).

`KVManager` is the contract: it decides what to load, store and persist and keeps the
two-phase bookkeeping; transfer handlers move the bytes. Every `prepare_*` pins what it
returns (host slots reserved or referenced) and the matching `complete_*` releases it,
so a block being loaded or stored is never evicted or reused mid-transfer.

    load:    lookup -> prepare_load -> [cold -> host jobs, complete_stage]
             -> host -> device job -> complete_load
    store:   prepare_store -> device -> host job -> complete_store
             -> (prefix blocks only) prepare_persist -> host -> cold jobs -> complete_persist

Invariants: a block whose store has not completed is not loadable (host entries stay
PENDING until `complete_store(success=True)`); `lookup` and `touch` do no I/O and
`lookup` changes no state, so the scheduler may call them inside a step; cold media are
read only by transfer jobs.

`TieredManager` is the one implementation: host RAM (bounded slab; its eviction policy
lives in lru.py, apart from the storage) in front of the configured cold media, looked
up in order. It never names a medium: "disk" is just the first entry of `media`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from tierguard.common.stats import counter
from tierguard.kv.media import ColdMedium
from tierguard.kv.media.host import HostTier

HOST = HostTier.name


@dataclass
class PlannedBlock:
    block_hash: int
    host_slot: int
    source: str  # HOST: already in RAM; else the cold medium it is staged from into `host_slot`


@dataclass
class LoadPlan:
    """The leading blocks that will be loaded, in order; the rest of the request recomputes."""

    blocks: list[PlannedBlock]

    def staged(self) -> dict[str, list[PlannedBlock]]:
        """Blocks to stage into host RAM first, per cold medium, in order."""
        out: dict[str, list[PlannedBlock]] = {}
        for b in self.blocks:
            if b.source != HOST:
                out.setdefault(b.source, []).append(b)
        return out


@dataclass
class StorePlan:
    to_store: list[tuple[int, int]]  # (block hash, reserved host slot), in order
    evicted: list[int] = field(default_factory=list)  # host blocks dropped to make room


@dataclass
class PersistPlan:
    medium: str
    blocks: list[tuple[int, int]]  # (block hash, host slot pinned for reading)


@dataclass
class ManagerStats:
    hits: dict[str, int] = counter(
        "Blocks loaded per tier (staged from a cold tier counts there).", "{key}_hits", {}
    )
    misses: int = counter("Requested blocks found in no tier (recomputed).", "tier_misses")
    stage_failures: int = counter("Cold blocks that failed to stage (turned into misses).")
    host_evictions: int = counter("Host-RAM blocks evicted to make room.")
    stores: int = 0
    store_failures: int = counter("Blocks whose copy to host RAM failed.")
    persisted: int = counter("Blocks written behind to a cold tier.", "persisted_blocks")
    persist_failures: int = 0


class KVManager(ABC):
    """The manager's contract (see the module docstring for the call order).

    Block lists are chains: block i's hash covers blocks 0..i, so every answer is about
    leading blocks and stops at the first gap. The engine thread calls every method but
    `stats`; an implementation does no I/O and never raises for a block it cannot serve:
    it plans fewer blocks. Every block a `prepare_*` returns stays pinned (its host slot
    neither evicted nor reused) until the caller ends that plan with the matching
    `complete_*`, once.
    """

    @abstractmethod
    def lookup(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` some tier holds. No I/O and no state
        change, so it is safe inside a step; a block counted here may still fail to pin
        or to stage later."""

    @abstractmethod
    def touch(self, hashes: list[int]) -> None:
        """These blocks were just used (e.g. device prefix hits): keep their host copies
        warm for eviction. No I/O."""

    @abstractmethod
    def prepare_load(self, hashes: list[int]) -> LoadPlan:
        """Pin the leading loadable blocks of `hashes`, in order; stops at the first block
        that no tier holds or that cannot be pinned (every host slot pinned). Host blocks
        are pinned for reading; a cold block gets a reserved host slot to be staged into
        (`LoadPlan.staged`). The caller ends the plan with `complete_stage` when it has
        staged blocks, then always with `complete_load`."""

    @abstractmethod
    def complete_stage(self, plan: LoadPlan, ok: dict[int, bool]) -> int:
        """The cold -> host copies of `plan` ended; `ok[hash]` says which arrived intact.
        Publishes those in host RAM and returns how many leading blocks stay loadable;
        every later block is released here. The caller loads only that prefix."""

    @abstractmethod
    def complete_load(self, plan: LoadPlan, keep: int) -> None:
        """Unpin the first `keep` blocks of `plan` once their host -> device copy ended
        (or was given up)."""

    @abstractmethod
    def prepare_store(self, hashes: list[int]) -> StorePlan:
        """Reserve host slots for the blocks of `hashes` not in host RAM yet, in order;
        stops at the first that gets no slot (storing fewer blocks is always safe). A
        reserved block is not loadable until `complete_store(plan, success=True)`."""

    @abstractmethod
    def complete_store(self, plan: StorePlan, success: bool) -> None:
        """The device -> host copy of `plan` ended: on success its blocks become
        loadable, otherwise their slots are freed."""

    @abstractmethod
    def prepare_persist(self, hashes: list[int]) -> list[PersistPlan]:
        """Per cold medium that accepts writes: the host-resident blocks of `hashes` it
        does not hold yet, pinned for reading. Each plan ends with `complete_persist`."""

    @abstractmethod
    def complete_persist(self, plan: PersistPlan, ok: list[bool]) -> None:
        """The host -> cold writes of `plan` ended (`ok` per block): unpin its host blocks."""

    @abstractmethod
    def stats(self) -> ManagerStats:
        """A copy of the counters; callable from any thread."""


class TieredManager(KVManager):
    def __init__(self, host: HostTier, media: list[ColdMedium] | None = None) -> None:
        self.host = host
        self.media = list(media or [])
        self._counters = ManagerStats(hits={HOST: 0, **{m.name: 0 for m in self.media}})
        self._lock = threading.Lock()  # guards counters only; the tiers lock themselves

    def _cold_source(self, block_hash: int) -> ColdMedium | None:
        return next((m for m in self.media if m.contains(block_hash)), None)

    def lookup(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if not (self.host.contains(h) or self._cold_source(h) is not None):
                break
            n += 1
        return n

    def touch(self, hashes: list[int]) -> None:
        for h in hashes:
            self.host.touch(h)

    def prepare_load(self, hashes: list[int]) -> LoadPlan:
        """Host blocks are pinned for reading; cold ones get a reserved host slot to be
        staged into. Counts hits per tier and the requested blocks left as misses."""
        blocks: list[PlannedBlock] = []
        evicted = 0
        for h in hashes:
            slot = self.host.begin_read(h)
            if slot is not None:
                blocks.append(PlannedBlock(h, slot, HOST))
                continue
            medium = self._cold_source(h)
            if medium is None:
                break
            reservation = self.host.reserve(h)
            if reservation is None:  # every host slot is pinned right now
                break
            evicted += len(reservation.evicted)
            blocks.append(PlannedBlock(h, reservation.slot, medium.name))
        with self._lock:
            c = self._counters
            for b in blocks:
                c.hits[b.source] += 1
            c.misses += len(hashes) - len(blocks)
            c.host_evictions += evicted
        return LoadPlan(blocks)

    def complete_stage(self, plan: LoadPlan, ok: dict[int, bool]) -> int:
        """A failed block (I/O error, bad checksum, undecodable) frees its slot; it and
        every later block are released here, since a chain cannot skip a block. The caller
        then loads only the returned prefix and calls `complete_load` with it."""
        keep = failed = 0
        broken = False
        failed_by: dict[str, int] = {}
        for b in plan.blocks:
            staged = b.source != HOST
            good = not broken and (not staged or ok[b.block_hash])
            if staged:
                if not ok[b.block_hash]:
                    failed += 1
                    failed_by[b.source] = failed_by.get(b.source, 0) + 1
                self.host.finish_write(b.block_hash, ok[b.block_hash], keep_pinned=good)
            elif not good:
                self.host.finish_read(b.block_hash)
            broken = broken or not good
            keep += 1 if good else 0
        with self._lock:
            c = self._counters
            c.stage_failures += failed
            c.misses += len(plan.blocks) - keep
            for source, n in failed_by.items():
                c.hits[source] -= n
        return keep

    def complete_load(self, plan: LoadPlan, keep: int) -> None:
        for b in plan.blocks[:keep]:
            self.host.finish_read(b.block_hash)

    def prepare_store(self, hashes: list[int]) -> StorePlan:
        out = StorePlan(to_store=[])
        for h in hashes:
            if self.host.is_present(h):
                continue
            reservation = self.host.reserve(h)
            if reservation is None:
                break  # every slot pinned: storing fewer blocks is always safe
            out.to_store.append((h, reservation.slot))
            out.evicted.extend(reservation.evicted)
        with self._lock:
            self._counters.host_evictions += len(out.evicted)
        return out

    def complete_store(self, plan: StorePlan, success: bool) -> None:
        for h, _slot in plan.to_store:
            self.host.finish_write(h, success)
        with self._lock:
            if success:
                self._counters.stores += len(plan.to_store)
            else:
                self._counters.store_failures += len(plan.to_store)

    def prepare_persist(self, hashes: list[int]) -> list[PersistPlan]:
        plans = []
        for medium in self.media:
            if not medium.writes_enabled:
                continue
            blocks = []
            for h in hashes:
                if medium.contains(h):
                    continue
                slot = self.host.begin_read(h)
                if slot is not None:
                    blocks.append((h, slot))
            if blocks:
                plans.append(PersistPlan(medium.name, blocks))
        return plans

    def complete_persist(self, plan: PersistPlan, ok: list[bool]) -> None:
        for h, _slot in plan.blocks:
            self.host.finish_read(h)
        with self._lock:
            self._counters.persisted += sum(ok)
            self._counters.persist_failures += len(ok) - sum(ok)

    def stats(self) -> ManagerStats:
        with self._lock:
            c = self._counters
            return ManagerStats(
                dict(c.hits),
                c.misses,
                c.stage_failures,
                c.host_evictions,
                c.stores,
                c.store_failures,
                c.persisted,
                c.persist_failures,
            )
