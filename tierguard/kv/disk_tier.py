"""NVMe tier: one checksummed file per block under `<root>/<fingerprint>/`.

What it promises (the cold contract's disk half):
- Only prefix blocks and saved session states are written here, never hot KV; the
  caller decides what to store, this class makes sure whatever it stores is whole.
- A write is atomic: temporary file (O_EXCL, 0600) -> write -> fdatasync -> rename ->
  fsync of the directory. A reader sees either the whole block or nothing.
- Every failure is a miss: absent file, torn or foreign header, bad checksum, disk full
  or any I/O error returns False and is counted; only `ColdContractViolation` (a read
  from inside a decode step, a programming error) is raised.
- Disk full (ENOSPC) or `max_consecutive_write_errors` failures in a row disable writes;
  `healthy` turns False with a `reason`; reads of existing blocks keep working.
- The index is rebuilt on start by scanning the directory, so saved prefixes survive a
  restart; leftovers of a killed writer and unreadable files are removed then.
- Budget: when a write would exceed `capacity_bytes`, the least recently used blocks of
  this fingerprint are removed first. Other fingerprints' subdirectories are never touched
  (they may belong to another running server).

All file operations go through a directory fd opened with O_NOFOLLOW and use fixed file
names, so nothing is created outside the configured directory, even via symlinks.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xxhash

from tierguard.kv import disk_format as fmt
from tierguard.kv.faults import FaultInjector
from tierguard.kv.guard import check_disk_read_allowed, decode_in_progress
from tierguard.kv.spec import is_fingerprint

_OPEN_FLAGS = fmt.OPEN_FLAGS
_COUNTERS = (
    "hits misses writes write_bytes read_bytes corrupt io_errors write_errors evictions "
    "rejected_writes reads_in_decode cleaned_on_start"
).split()


@dataclass
class DiskTierStats:
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    misses: int
    writes: int
    write_bytes: int
    read_bytes: int
    corrupt: int
    io_errors: int
    write_errors: int
    evictions: int
    rejected_writes: int
    reads_in_decode: int
    cleaned_on_start: int
    healthy: bool
    writes_enabled: bool
    reason: str


class DiskTier:
    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: str,
        capacity_bytes: int,
        *,
        faults: FaultInjector | None = None,
        allow_reads_in_decode: bool = False,
        max_consecutive_write_errors: int = 3,
    ) -> None:
        if not is_fingerprint(fingerprint):
            raise ValueError(f"fingerprint must be 16 lowercase hex chars, got {fingerprint!r}")
        self.root = os.path.realpath(os.fspath(root))
        self.fingerprint = fingerprint
        self.capacity_bytes = int(capacity_bytes)
        self.faults = faults or FaultInjector()
        self.allow_reads_in_decode = allow_reads_in_decode
        self.max_consecutive_write_errors = max_consecutive_write_errors
        self.healthy = True
        self.writes_enabled = True
        self.reason = ""
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._used = 0
        self._reserved = 0  # bytes of writes in flight, counted against the budget
        self._seq = itertools.count()
        self._consecutive_write_errors = 0
        self._c = dict.fromkeys(_COUNTERS, 0)
        self._dir_fd: int | None = None
        self._open_dir()
        if self._dir_fd is not None:
            self._rebuild_index()
            self._probe_writable()
            self._enforce_budget()

    # ---- start-up ----

    def _disable(self, reason: str) -> None:
        self.healthy = False
        self.writes_enabled = False
        self.reason = reason

    def _open_dir(self) -> None:
        path = os.path.join(self.root, self.fingerprint)
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            self._dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
        except OSError as e:
            reason = "symlinked tier directory refused" if e.errno in (errno.ELOOP, errno.ENOTDIR) else str(e)
            self._disable(f"cannot open {path}: {reason}")

    def _rebuild_index(self) -> None:
        blocks, leftovers = fmt.scan_dir(self._dir_fd, self.fingerprint)
        for name in leftovers:
            self._unlink(name)
        self._c["cleaned_on_start"] += len(leftovers)
        for block_hash, size in blocks:
            self._index[block_hash] = size
            self._used += size

    def _probe_writable(self) -> None:
        name = fmt.temp_name(0, os.getpid(), next(self._seq))
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600, dir_fd=self._dir_fd)
            os.close(fd)
            os.unlink(name, dir_fd=self._dir_fd)
        except OSError as e:
            self._disable(f"directory not writable: {e.strerror or e}")

    def _enforce_budget(self) -> None:
        with self._lock:
            victims = self._evict_locked(0)
        for h in victims:
            self._unlink(fmt.block_name(h))

    # ---- queries ----

    def contains(self, block_hash: int) -> bool:
        """Index lookup only (no I/O), so it is safe anywhere, including inside decode."""
        with self._lock:
            return block_hash in self._index

    def payload_len(self, block_hash: int) -> int | None:
        with self._lock:
            size = self._index.get(block_hash)
        return None if size is None else size - fmt.HEADER_LEN

    # ---- writes ----

    def write(self, block_hash: int, payload: torch.Tensor | bytes | bytearray | memoryview) -> bool:
        """Store one block durably; False (counted) when it could not be stored."""
        return self.write_many([(block_hash, payload)])[0]

    def write_many(
        self, items: list[tuple[int, torch.Tensor | bytes | bytearray | memoryview]]
    ) -> list[bool]:
        """Store several blocks, each atomically, with one directory fsync for the batch."""
        results = [self._write_one(h, fmt.as_buffer(p)) for h, p in items]
        if any(results):
            try:
                os.fsync(self._dir_fd)
            except OSError:
                pass  # the files are whole; at worst a crash forgets a rename (a miss)
        return results

    def _write_one(self, block_hash: int, mv: memoryview) -> bool:
        if not 0 <= block_hash <= fmt.U64_MAX:
            raise ValueError(f"block hash must be an unsigned 64-bit int, got {block_hash}")
        size = fmt.HEADER_LEN + mv.nbytes
        with self._lock:
            if not self.writes_enabled or self._dir_fd is None or size > self.capacity_bytes:
                self._c["rejected_writes"] += 1
                return False
            if block_hash in self._index:
                return True  # same (fingerprint, hash) means same bytes
            victims = self._evict_locked(size)
            self._reserved += size
        for h in victims:
            self._unlink(fmt.block_name(h))
        tmp = fmt.temp_name(block_hash, os.getpid(), next(self._seq))
        header = fmt.encode_header(
            fmt.Header(self.fingerprint, block_hash, mv.nbytes, xxhash.xxh3_64_intdigest(mv))
        )
        try:
            self.faults.check("disk.write")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600, dir_fd=self._dir_fd)
            try:
                self._write_all(fd, memoryview(header))
                self._write_all(fd, mv)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, fmt.block_name(block_hash), src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError as e:
            self._unlink(tmp)
            self._record_write_error(e, size)
            return False
        with self._lock:
            self._reserved -= size
            # A concurrent write of the same block may have landed first; the rename
            # replaced its file, so count the bytes once.
            self._used += size - self._index.pop(block_hash, 0)
            self._index[block_hash] = size
            self._consecutive_write_errors = 0
            self._c["writes"] += 1
            self._c["write_bytes"] += size
        return True

    @staticmethod
    def _write_all(fd: int, mv: memoryview) -> None:
        while mv.nbytes:
            n = os.write(fd, mv)
            mv = mv[n:]

    def _record_write_error(self, e: OSError, size: int) -> None:
        with self._lock:
            self._reserved -= size
            self._c["write_errors"] += 1
            self._consecutive_write_errors += 1
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._disable(f"disk full ({e.strerror}); writes disabled")
            elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                self._disable(f"directory not writable ({e.strerror}); writes disabled")
            elif self._consecutive_write_errors >= self.max_consecutive_write_errors:
                self._disable(
                    f"{self._consecutive_write_errors} consecutive write errors, last: {e.strerror}"
                )

    def _evict_locked(self, incoming: int) -> list[int]:
        """Drop LRU entries from the index until `incoming` bytes fit; caller unlinks them."""
        victims = []
        while self._index and self._used + self._reserved + incoming > self.capacity_bytes:
            h, size = self._index.popitem(last=False)
            self._used -= size
            victims.append(h)
            self._c["evictions"] += 1
        return victims

    # ---- reads ----

    def read_into(self, block_hash: int, out: torch.Tensor | bytearray | memoryview) -> bool:
        """Fill `out` with the block's payload; False (counted) on any kind of miss.

        Raises ColdContractViolation when called from inside a decode step (unless this
        tier was built for the naive benchmark mode, where such reads are counted).
        """
        return self.read_many([(block_hash, out)])[0]

    def read_many(
        self, items: list[tuple[int, torch.Tensor | bytearray | memoryview]], ahead: int = 4
    ) -> list[bool]:
        """Read several blocks in order, asking the kernel for the next `ahead` files while
        reading the current one. Per-file reads otherwise wait for each file's first I/O
        with nothing queued behind it; prefetching measured 1.6x on single-threaded cold
        reads on the development VM."""
        self._check_guard(len(items))
        dsts = [fmt.as_buffer(out) for _, out in items]
        opened: dict[int, tuple[int | None, str]] = {}
        results = []
        try:
            for i, (block_hash, _) in enumerate(items):
                for j in range(i, min(len(items), i + 1 + ahead)):
                    if j not in opened:
                        opened[j] = self._open_block(items[j][0], prefetch=j > i)
                results.append(self._finish_read(block_hash, opened.pop(i), dsts[i]))
        finally:
            for fd, _ in opened.values():  # only non-empty if a read raised
                if fd is not None:
                    os.close(fd)
        return results

    def _check_guard(self, n: int) -> None:
        if not decode_in_progress():
            return
        if not self.allow_reads_in_decode:
            check_disk_read_allowed(f"{n} block(s)")
        with self._lock:
            self._c["reads_in_decode"] += n

    def _open_block(self, block_hash: int, prefetch: bool) -> tuple[int | None, str]:
        """(fd, "") or (None, counter naming the miss)."""
        with self._lock:
            if block_hash not in self._index:
                return None, "absent"
        try:
            self.faults.check("disk.read")
            fd = os.open(fmt.block_name(block_hash), os.O_RDONLY | _OPEN_FLAGS, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return None, "misses"
        except OSError:
            return None, "io_errors"
        if prefetch:
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # only a hint
        return fd, ""

    def _finish_read(self, block_hash: int, opened: tuple[int | None, str], dst: memoryview) -> bool:
        fd, why = opened
        if fd is None:
            if why == "absent":
                with self._lock:
                    self._c["misses"] += 1
                return False
            return self._miss(block_hash, why, unlink=False)
        try:
            head = bytearray(fmt.HEADER_LEN)
            whole = fmt.read_all(fd, memoryview(head), dst)  # one I/O for header and payload
            header = fmt.decode_header(bytes(head))
            ok = whole and header.fingerprint == self.fingerprint and header.block_hash == block_hash
            ok = (
                ok
                and header.payload_len == dst.nbytes
                and os.fstat(fd).st_size == fmt.HEADER_LEN + dst.nbytes
            )
            ok = ok and xxhash.xxh3_64_intdigest(dst) == header.payload_xxh3
        except fmt.BadHeader:
            ok = False
        except OSError:
            return self._miss(block_hash, "io_errors", unlink=False)
        finally:
            os.close(fd)
        if not ok:
            return self._miss(block_hash, "corrupt", unlink=True)
        with self._lock:
            self._c["hits"] += 1
            self._c["read_bytes"] += fmt.HEADER_LEN + dst.nbytes
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        return True

    def read(self, block_hash: int) -> bytes | None:
        """The block's payload as bytes, or None on a miss (same rules as `read_into`)."""
        n = self.payload_len(block_hash)
        if n is None:
            self.read_into(block_hash, bytearray(0))  # counts the miss (and enforces the guard)
            return None
        buf = bytearray(n)
        return bytes(buf) if self.read_into(block_hash, buf) else None

    def _miss(self, block_hash: int, counter: str, unlink: bool) -> bool:
        with self._lock:
            self._c[counter] += 1
            if counter != "misses":
                self._c["misses"] += 1
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._used -= size
        if unlink:
            self._unlink(fmt.block_name(block_hash))
        return False

    # ---- housekeeping ----

    def remove(self, block_hash: int) -> bool:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._used -= size
        if size is not None:
            self._unlink(fmt.block_name(block_hash))
        return size is not None

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except OSError:
            pass

    def close(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=self._used,
                num_blocks=len(self._index),
                healthy=self.healthy,
                writes_enabled=self.writes_enabled,
                reason=self.reason,
                **self._c,
            )
