"""Host-RAM tier: a bounded slab of block slots, two-phase pins, and an eviction policy.

Why a preallocated slab: the budget (`--kv-host-gib`) is reserved once and never grows,
so the tier cannot creep into the RAM kept for the OS, page cache and bursts (R6). On CUDA
the slab is pinned so device<->host copies run asynchronously; pinning is limited to this
slab, never "all free RAM".

Two-phase bookkeeping: an entry being written (`reserve` .. `finish_write`) or read
(`begin_read` .. `finish_read`) has a reference count above zero and is never evicted or
reused; only READY entries with no references are eviction candidates, and the policy
(`LRUPolicy` by default, tierguard/kv/lru.py) chooses among them.

Invariants (see `check_integrity`): every slot is either free or owned by exactly one
entry; a PENDING entry is not loadable; the policy holds exactly the READY, unreferenced
entries.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

import torch

from tierguard.common.stats import counter, gauge
from tierguard.kv.lru import EvictionPolicy, LRUPolicy


class EntryState(enum.Enum):
    PENDING = "pending"  # bytes are being written; not loadable yet
    READY = "ready"


@dataclass
class _Entry:
    slot: int
    state: EntryState
    refs: int


@dataclass
class Reservation:
    """A slot reserved for writing `block_hash`, and the READY blocks evicted to make room."""

    block_hash: int
    slot: int
    evicted: list[int]


@dataclass
class HostTierStats:
    capacity_bytes: int = gauge("Host-RAM KV tier budget in bytes.", name="bytes_capacity")
    used_bytes: int = gauge("Host-RAM KV tier bytes held (ready or being written).", name="bytes_used")
    num_slots: int = 0
    num_ready: int = 0
    num_pending: int = 0
    evictions: int = counter("Blocks evicted from host RAM to make room.")


class HostTier:
    """Bounded host store keyed by block hash. Thread-safe; every call is O(1) amortized."""

    name = "host"

    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: int,
        pin_memory: bool | None = None,
        policy: EvictionPolicy | None = None,
        slab: torch.Tensor | None = None,
    ) -> None:
        """`slab`: rows the caller allocated (uint8, [slots, >= block_bytes]), e.g. shared
        memory another process copies through; by default the tier allocates its own."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes
        self.num_slots = max(0, int(capacity_bytes) // block_bytes)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if slab is not None:
            if slab.dtype != torch.uint8 or slab.dim() != 2 or slab.shape[1] < block_bytes:
                raise ValueError(
                    f"host slab must be uint8 [slots, >= {block_bytes}], got {slab.dtype} {tuple(slab.shape)}"
                )
            self.num_slots = min(self.num_slots, int(slab.shape[0]))
            self.slab = slab
            self.pinned = False
        else:
            # One allocation for the whole budget; rows are block slots.
            self.slab = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin_memory)
            self.pinned = bool(pin_memory)
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._entries: dict[int, _Entry] = {}
        self._lru: EvictionPolicy = policy if policy is not None else LRUPolicy()  # READY, unreferenced
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    def slot_view(self, slot: int) -> torch.Tensor:
        """The uint8 bytes of one slot (valid while the caller holds a reference)."""
        return self.slab[slot]

    # ---- queries (do not modify the tier) ----

    def contains(self, block_hash: int) -> bool:
        """True only for READY entries: a block whose store has not completed is not loadable."""
        with self._lock:
            entry = self._entries.get(block_hash)
            return entry is not None and entry.state is EntryState.READY

    def is_present(self, block_hash: int) -> bool:
        """True for READY or PENDING entries (used to avoid storing a block twice)."""
        with self._lock:
            return block_hash in self._entries

    # ---- store: reserve -> (copy bytes in) -> finish_write ----

    def reserve(self, block_hash: int) -> Reservation | None:
        """Reserve a slot for a new block, evicting unreferenced READY blocks oldest first.

        Returns None when the block is already present or every slot is referenced.
        The new entry is PENDING with one reference until `finish_write`.
        """
        with self._lock:
            if block_hash in self._entries:
                return None
            evicted: list[int] = []
            if not self._free:
                victim = self._lru.pop_victim()
                if victim is None:
                    return None
                victim_entry = self._entries.pop(victim)
                self._free.append(victim_entry.slot)
                evicted.append(victim)
                self.evictions += 1
            slot = self._free.pop()
            self._entries[block_hash] = _Entry(slot=slot, state=EntryState.PENDING, refs=1)
            return Reservation(block_hash=block_hash, slot=slot, evicted=evicted)

    def finish_write(self, block_hash: int, success: bool, keep_pinned: bool = False) -> None:
        """Publish a written block (READY, most recently used) or release its slot on failure.

        `keep_pinned=True` turns the writer's reference into a reader's one, so a block
        staged from disk cannot be evicted before it is copied on to the device; the
        caller then owes one `finish_read`.
        """
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None or entry.state is not EntryState.PENDING:
                raise KeyError(f"block {block_hash:#x} has no pending write")
            if not (success and keep_pinned):
                entry.refs -= 1
            if not success:
                if entry.refs:
                    raise RuntimeError(f"block {block_hash:#x} failed while still referenced")
                del self._entries[block_hash]
                self._free.append(entry.slot)
                return
            entry.state = EntryState.READY
            if entry.refs == 0:
                self._lru.insert(block_hash)

    # ---- load: begin_read -> (copy bytes out) -> finish_read ----

    def begin_read(self, block_hash: int) -> int | None:
        """Pin a READY block for reading and mark it most recently used; None on a miss."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None or entry.state is not EntryState.READY:
                return None
            entry.refs += 1
            self._lru.remove(block_hash)
            return entry.slot

    def finish_read(self, block_hash: int) -> None:
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None or entry.refs <= 0:
                raise KeyError(f"block {block_hash:#x} is not being read")
            entry.refs -= 1
            if entry.refs == 0 and entry.state is EntryState.READY:
                self._lru.insert(block_hash)  # re-enters as the most recently used

    def touch(self, block_hash: int) -> None:
        """Mark a READY, unreferenced block as just used (it is evicted later)."""
        with self._lock:
            self._lru.touch(block_hash)

    def discard(self, block_hash: int) -> bool:
        """Drop an unreferenced READY block (e.g. its contents are known stale)."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None or entry.refs or entry.state is not EntryState.READY:
                return False
            del self._entries[block_hash]
            self._lru.remove(block_hash)
            self._free.append(entry.slot)
            return True

    def clear(self) -> int:
        """Drop every READY, unreferenced block (a cache reset); returns how many."""
        with self._lock:
            victims = list(self._lru)
            for h in victims:
                entry = self._entries.pop(h)
                self._lru.remove(h)
                self._free.append(entry.slot)
            return len(victims)

    # ---- accounting ----

    def stats(self) -> HostTierStats:
        with self._lock:
            pending = sum(1 for e in self._entries.values() if e.state is EntryState.PENDING)
            return HostTierStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=len(self._entries) * self.block_bytes,
                num_slots=self.num_slots,
                num_ready=len(self._entries) - pending,
                num_pending=pending,
                evictions=self.evictions,
            )

    def check_integrity(self) -> None:
        """Raise if free + owned slots != total, a slot is owned twice, or LRU holds a pinned entry."""
        with self._lock:
            owned = [e.slot for e in self._entries.values()]
            if len(owned) + len(self._free) != self.num_slots:
                raise RuntimeError(
                    f"host tier: {len(owned)} owned + {len(self._free)} free != {self.num_slots}"
                )
            if len(set(owned) | set(self._free)) != self.num_slots:
                raise RuntimeError("host tier: a slot is owned twice or both owned and free")
            for h in self._lru:
                e = self._entries.get(h)
                if e is None or e.refs or e.state is not EntryState.READY:
                    raise RuntimeError(f"host tier: eviction policy holds non-evictable block {h:#x}")
            for h, e in self._entries.items():
                if e.state is EntryState.READY and e.refs == 0 and h not in self._lru:
                    raise RuntimeError(f"host tier: evictable block {h:#x} missing from the eviction policy")
