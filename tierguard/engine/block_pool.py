"""The pool of physical KV blocks on the device: allocation, reference counts, eviction.

Every block is in exactly one of three states:

    free    ref 0, no hash        -> allocatable at once
    cached  ref 0, hash known     -> allocatable, but first evicted (LRU order); a
                                     prefix-cache hit revives it without recompute
    used    ref > 0               -> owned by one or more running sequences

`check_integrity()` verifies free + cached + used == total. With `record_evictions`, the
hash of every evicted cached block is kept until `take_evicted()`: the KV connector reads
them once per step to count prefix blocks lost with no copy in a tier (copies are made
when a sequence ends, never at eviction, which would have to delay the reuse).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


class BlockPoolExhausted(RuntimeError):
    """Raised by allocate() when no free or cached block is left (callers check first)."""


@dataclass
class CachedBlock:
    block_hash: int
    token_ids: tuple[int, ...]  # kept to rule out hash collisions on lookup


class BlockPool:
    def __init__(self, num_blocks: int, record_evictions: bool = False) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cached: list[CachedBlock | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._by_hash: dict[int, int] = {}
        self._num_used = 0
        self.record_evictions = record_evictions
        self._evicted: list[int] = []  # hashes evicted since take_evicted(), when recorded
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks allocatable now (free + cached)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self._num_used

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The block holding this content, or None. Does not modify the pool."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        entry = self.cached[block_id]
        if entry is None or entry.token_ids != token_ids:
            return None  # hash collision
        return block_id

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._cached_free

    def allocate(self) -> int:
        """A block with ref 1 and no hash; evicts the least recently freed cached block
        only when no plain free block is left."""
        if self._free:
            block_id = self._free.popleft()
        elif self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)
            self._evict(block_id)
        else:
            raise BlockPoolExhausted("no free KV blocks")
        self.ref_counts[block_id] = 1
        self._num_used += 1
        return block_id

    def acquire(self, block_id: int) -> None:
        """Take one more reference to a block found by lookup()."""
        if self.ref_counts[block_id] == 0:
            del self._cached_free[block_id]
            self._num_used += 1
        self.ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes cached (if hashed) or free."""
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"release of block {block_id} with no references")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._num_used -= 1
            if self.cached[block_id] is not None:
                self._cached_free[block_id] = None  # most recently used end
            else:
                self._free.append(block_id)

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Publish a computed full block under its hash. Returns False when another block
        already holds the same content (this one then stays anonymous)."""
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"register of unowned block {block_id}")
        if self.cached[block_id] is not None or block_hash in self._by_hash:
            return False
        self.cached[block_id] = CachedBlock(block_hash, token_ids)
        self._by_hash[block_hash] = block_id
        return True

    def drop_cached(self, block_id: int) -> bool:
        """Forget one cached-free block's content now (its KV now lives elsewhere) and make
        it plain free; False, changing nothing, unless the block is cached-free."""
        if block_id not in self._cached_free:
            return False
        del self._cached_free[block_id]
        self._evict(block_id)
        self._free.append(block_id)
        return True

    def evict_all_cached(self) -> int:
        """Drop every cached-free block (e.g. to reset the prefix cache). Returns the count."""
        oldest_first = list(self._cached_free)
        for block_id in oldest_first:
            self.drop_cached(block_id)
        return len(oldest_first)

    def take_evicted(self) -> list[int]:
        """Hashes of the cached blocks evicted since the last call (empty unless recorded)."""
        out, self._evicted = self._evicted, []
        return out

    def _evict(self, block_id: int) -> None:
        entry = self.cached[block_id]
        if entry is None:
            return
        if self.record_evictions:
            self._evicted.append(entry.block_hash)
        del self._by_hash[entry.block_hash]
        self.cached[block_id] = None
        self.num_evictions += 1

    def check_integrity(self) -> None:
        """Raise RuntimeError unless free + cached + used == total and states are consistent."""
        free, cached_free = set(self._free), set(self._cached_free)
        used = {b for b, r in enumerate(self.ref_counts) if r > 0}
        problems = []
        if len(free) != len(self._free):
            problems.append("duplicate ids in the free list")
        if free & cached_free or free & used or cached_free & used:
            problems.append("a block is in two states")
        if len(free) + len(cached_free) + len(used) != self.num_blocks:
            problems.append(
                f"free {len(free)} + cached {len(cached_free)} + used {len(used)} != total {self.num_blocks}"
            )
        if len(used) != self._num_used:
            problems.append(f"used counter {self._num_used} != {len(used)}")
        if any(r < 0 for r in self.ref_counts):
            problems.append("negative reference count")
        if any(self.cached[b] is not None for b in free):
            problems.append("a free block still has a hash")
        if any(self.cached[b] is None for b in cached_free):
            problems.append("a cached block has no hash")
        for h, b in self._by_hash.items():
            entry = self.cached[b]
            if entry is None or entry.block_hash != h:
                problems.append(f"hash index points at block {b} that does not hold it")
                break
        if problems:
            raise RuntimeError("KV block pool integrity: " + "; ".join(problems))
