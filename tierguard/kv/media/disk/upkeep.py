"""Upkeep of the disk tier, on a sweeper thread of its own (never the engine's thread).

Two jobs, both optional, both counted in /metrics:
- time to live (`--kv-disk-ttl-s`): remove blocks not written or read for that long
  (`kv_disk_expired`). The clock is the file's mtime, which a read hit touches, so it
  survives restarts and `tierguard kv purge --older-than` reads the same clock;
- key rotation (`--kv-encrypt-old-key-file`): blocks sealed with the old key are read,
  opened and sealed again with the current one (`kv_disk_resealed`), so the old key can
  be retired once `kv_disk_old_key_blocks` reaches 0. A reseal is not a use: the block
  keeps its clock.

`DiskUpkeep` is a mixin of `DiskTier` (disk_tier.py), split out to keep one concern per
file; it works on the tier's index under the tier's lock (`self` is the DiskTier; not
imported here, which would be an import cycle).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from tierguard.kv.media.disk import format as fmt

log = logging.getLogger("tierguard.kv.disk")


class Sweeper:
    """A daemon thread calling `work` every `interval_s` until stopped."""

    def __init__(self, work: Callable[[], object], interval_s: float, name: str) -> None:
        self._work = work
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._work()
            except Exception:  # a sweep that fails is retried next time, never fatal
                log.exception("disk tier sweep failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


def sweep_interval(ttl_s: float, given: float | None) -> float:
    """A quarter of the TTL (within 50 ms..60 s), or once a second for resealing only."""
    if given:
        return given
    return min(60.0, max(0.05, ttl_s / 4)) if ttl_s > 0 else 1.0


class DiskUpkeep:
    """TTL expiry and resealing for `DiskTier` (see the module docstring)."""

    def housekeep(self: Any) -> None:
        self.expire()
        self.reseal()

    def expire(self: Any, now: float | None = None) -> int:
        """Remove blocks not written or read for `ttl_s` seconds; returns how many."""
        if self.ttl_s <= 0 or self._dir_fd is None:
            return 0
        cutoff = (time.time() if now is None else now) - self.ttl_s
        with self._lock:
            victims = [h for h, t in self._touched.items() if t < cutoff]
            for h in victims:
                self._forget_locked(h)
                self._lru.remove(h)
            self._c["expired"] += len(victims)
        for h in victims:
            self._unlink(fmt.block_name(h))
        return len(victims)

    def reseal(self: Any, limit: int = 64) -> int:
        """Rewrite up to `limit` blocks sealed with an old key under the current one (read,
        open with the old key, seal, atomic replace); returns how many were resealed."""
        with self._lock:
            todo = list(itertools.islice(self._old_key, limit))
        if todo:
            self._check_guard(len(todo))  # the sweeper's thread is never in decode; a caller might be
        done = 0
        for h in todo:
            n = self.payload_len(h)
            buf = memoryview(bytearray(max(0, n or 0)))
            ok = n is not None and self._finish_read(h, self._open_block(h, prefetch=False), buf, use=False)
            with self._lock:
                self._old_key.discard(h)
                touched = self._touched.get(h)
            if not ok or touched is None:
                continue  # gone, corrupt or undecodable: the read counted it
            try:
                self._store_file(h, buf)
                # A reseal is not a use: keep the block's clock (TTL, LRU after a restart).
                os.utime(fmt.block_name(h), (touched, touched), dir_fd=self._dir_fd, follow_symlinks=False)
            except OSError as e:
                log.warning("reseal of block %016x failed: %s", h, e.strerror or e)
                continue
            with self._lock:
                self._c["resealed"] += 1
                gone = h not in self._index
            if gone:  # evicted or expired meanwhile: drop the new file too
                self._unlink(fmt.block_name(h))
            done += 1
        return done
