"""Eviction policy, kept apart from the storage it protects (as vLLM's `lru_manager.py`).

A tier's storage (host slab slots, block files) knows where bytes are; the policy only
knows which keys may go and in what order. Storage tells the policy when a key becomes
evictable (`insert`), is used (`touch`) or must stay (`remove`, e.g. while pinned by a
transfer), and asks it for victims (`pop_victim`). Not thread-safe: the owning tier calls
it under its own lock.

Another policy (ARC, LFU, a TTL) is one class with these four methods.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    def insert(self, key: int) -> None: ...

    def touch(self, key: int) -> None: ...

    def remove(self, key: int) -> None: ...

    def pop_victim(self) -> int | None: ...

    def __contains__(self, key: int) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[int]: ...


class LRUPolicy:
    """Least recently used first. Every call is O(1)."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def insert(self, key: int) -> None:
        """Make `key` evictable as the most recently used (re-inserting moves it)."""
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: int) -> None:
        """Mark an evictable key as just used; a key not held here is ignored."""
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: int) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> int | None:
        """The least recently used key, removed from the policy; None when nothing may go."""
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def __contains__(self, key: int) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)
