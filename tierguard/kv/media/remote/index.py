"""What one replica knows to be in the shared remote tier, without asking Redis.

Why a local index: the scheduler asks "is this block in some tier?" inside a step, where
a network round trip is forbidden. The index answers from memory; a load then confirms
(a key that expired or was evicted meanwhile is a counted miss and leaves the index).

Filled from two sources:
- this replica's own writes (`add_own`, after Redis acknowledged the SETs);
- the journal: a Redis stream `<ns>:<fingerprint>:journal` every replica appends one
  entry to per write job (`put`: the packed 256-bit hashes it stored; `del`: those it deleted
  to stay within its budget). `refresh` reads the entries after its cursor (server-
  assigned, monotonic stream ids: nothing is read twice or skipped) on the remote tier's
  refresh thread. Writers trim entries older than the TTL (`MINID`), so the stream holds
  only blocks that may still be alive, and a replica that starts later reads it whole.

A block's local expiry is its write time plus the TTL (the key's own PX), so the index
never claims a block Redis has already expired. When the node holding the journal restarts
(the same node with a new `run_id`: without persistence it came back empty), the index is
cleared and the journal read again from its start. In a Redis Cluster the journal is one
key, so it lives on one shard; when a replica takes that shard over (another node), the
journal it holds is the one the index read, so nothing is cleared: an entry the failover
lost only leaves its blocks unknown to the replicas that had not read it yet.

Budget: used bytes = known blocks x stored block size; `make_room` picks the least
recently used blocks to delete before a write would pass the budget (lru.py).

A block this replica deleted stays deleted in its index: until the journal entry that
announces the deletion comes back through `refresh`, an older `put` of that block (one the
refresh had not reached yet) is skipped, so the budget never counts a deleted block again.
Such a mark lasts at most the TTL, because every older `put` has expired by then.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tierguard.kv.lru import LRUPolicy

PAGE = 1000  # journal entries per XRANGE


HASH_BYTES = 32  # a block hash (tierguard/engine/prefix_hash.py), as journal entries carry it


def pack(hashes: list[int]) -> bytes:
    return b"".join(h.to_bytes(HASH_BYTES, "little") for h in hashes)


def unpack(raw: bytes | None) -> list[int]:
    raw, n = raw or b"", HASH_BYTES
    return [int.from_bytes(raw[i : i + n], "little") for i in range(0, len(raw) - len(raw) % n, n)]


class RemoteIndex:
    """Thread-safe. `refresh` talks to Redis (raises RedisError); everything else is local."""

    def __init__(self, client: Callable[[], Any], journal_key: str, ttl_ms: int, stored_bytes: int,
                 identity: Callable[[], tuple[str, str]]) -> None:
        self._client = client  # gives the client to read the journal with (a Redis or a RedisCluster)
        self.identity = identity  # (node, run id) of the journal's node
        self.journal_key = journal_key
        self.ttl_ms = ttl_ms
        self.stored_bytes = stored_bytes
        self.check_identity = True  # compare Redis' run id on the next refresh
        self._lock = threading.Lock()
        self._expiry: dict[int, float] = {}  # hash -> unix time the key expires
        self._lru = LRUPolicy()
        self._queue: deque[tuple[float, int]] = deque()  # (expiry, hash), roughly in expiry order
        self._deleted: dict[int, float] = {}  # hash we deleted -> when the mark lapses
        self._deleted_queue: deque[tuple[float, int]] = deque()  # in lapse order
        self._cursor = "-"  # last journal id applied
        self._run_id: tuple[str, str] | None = None  # (node, run id) of the journal's node

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)

    def contains(self, block_hash: int) -> bool:
        with self._lock:
            expiry = self._expiry.get(block_hash)
        return expiry is not None and expiry > time.time()

    # ---- local changes ----

    def _add(self, block_hash: int, expiry: float) -> bool:
        new = block_hash not in self._expiry
        if new or expiry > self._expiry[block_hash]:
            self._expiry[block_hash] = expiry
            self._queue.append((expiry, block_hash))
        if new:
            self._lru.insert(block_hash)
        return new

    def _remove(self, block_hash: int) -> bool:
        if self._expiry.pop(block_hash, None) is None:
            return False
        self._lru.remove(block_hash)
        return True

    def _mark_deleted(self, block_hash: int, now: float) -> None:
        lapse = now + self.ttl_ms / 1000.0
        self._deleted[block_hash] = lapse
        self._deleted_queue.append((lapse, block_hash))

    def add_own(self, hashes: list[int]) -> None:
        expiry = time.time() + self.ttl_ms / 1000.0
        with self._lock:
            for h in hashes:
                self._deleted.pop(h, None)
                self._add(h, expiry)

    def drop(self, hashes: list[int]) -> None:
        with self._lock:
            for h in hashes:
                self._remove(h)

    def touch(self, hashes: list[int]) -> None:
        with self._lock:
            for h in hashes:
                self._lru.touch(h)

    def make_room(self, incoming_bytes: int, capacity_bytes: int) -> list[int]:
        """Remove least recently used blocks until `incoming_bytes` more fit; the caller
        deletes them in Redis and announces the deletion."""
        victims, now = [], time.time()
        with self._lock:
            while self._expiry and (len(self._expiry) * self.stored_bytes + incoming_bytes > capacity_bytes):
                h = self._lru.pop_victim()
                if h is None:
                    break
                self._expiry.pop(h, None)
                self._mark_deleted(h, now)
                victims.append(h)
        return victims

    def unmark(self, hashes: list[int]) -> None:
        """The deletion of `hashes` was not announced (the write failed): no journal entry
        will lift their marks, so lift them now."""
        with self._lock:
            for h in hashes:
                self._deleted.pop(h, None)

    def expire(self) -> int:
        """Forget blocks whose TTL has passed; returns how many."""
        now, n = time.time(), 0
        with self._lock:
            while self._queue and self._queue[0][0] <= now:
                expiry, h = self._queue.popleft()
                if self._expiry.get(h) == expiry:
                    n += self._remove(h)
            while self._deleted_queue and self._deleted_queue[0][0] <= now:
                lapse, h = self._deleted_queue.popleft()
                if self._deleted.get(h) == lapse:
                    del self._deleted[h]
        return n

    # ---- the journal ----

    def announce(self, puts: list[int], dels: list[int]) -> list[tuple]:
        """The commands of one journal entry (trimming entries older than the TTL), for the
        pipeline of the journal's node; none when there is nothing to say."""
        fields: list[Any] = []
        if puts:
            fields += ["put", pack(puts)]
        if dels:
            fields += ["del", pack(dels)]
        if not fields:
            return []
        minid = max(0, int(time.time() * 1000) - self.ttl_ms)
        return [("XADD", self.journal_key, "MINID", "~", minid, "*", *fields),
                ("PEXPIRE", self.journal_key, 2 * self.ttl_ms)]  # a fleet that stopped leaves nothing behind

    def refresh(self) -> tuple[int, int, bool]:
        """Apply journal entries after the cursor: (blocks learned, blocks forgotten, reset)."""
        reset = False
        if self.check_identity:
            run_id = self.identity()
            with self._lock:
                old = self._run_id
                if old is not None and run_id[0] == old[0] and run_id[1] != old[1]:
                    self._expiry.clear()
                    self._lru = LRUPolicy()
                    self._queue.clear()
                    self._deleted.clear()
                    self._deleted_queue.clear()
                    self._cursor, reset = "-", True
                self._run_id = run_id
            self.check_identity = False
        learned = forgotten = 0
        while True:
            with self._lock:
                lo = "-" if self._cursor == "-" else "(" + self._cursor
            entries = self._client().xrange(self.journal_key, min=lo, max="+", count=PAGE) or []
            now = time.time()
            with self._lock:
                for entry_id, fields in entries:
                    eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    expiry = int(eid.split("-")[0]) / 1000.0 + self.ttl_ms / 1000.0
                    if expiry > now:
                        puts = [h for h in unpack(fields.get(b"put")) if h not in self._deleted]
                        learned += sum(self._add(h, expiry) for h in puts)
                    for h in unpack(fields.get(b"del")):
                        forgotten += self._remove(h)
                        self._deleted.pop(h, None)
                    self._cursor = eid
            if len(entries) < PAGE:
                return learned, forgotten, reset
