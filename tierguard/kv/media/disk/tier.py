"""NVMe tier: one checksummed file per block under `<root>/<fingerprint>/`.

What it promises (the cold contract's disk half):
- Only prefix blocks and saved session states are written here, never hot KV; the
  caller decides what to store, this class makes sure whatever it stores is whole.
- A write is atomic: temporary file (O_EXCL, 0600) -> write -> fdatasync -> rename ->
  fsync of the directory. A reader sees either the whole block or nothing.
- Every failure is a miss: absent file, torn or foreign header, bad checksum, a block
  the codec cannot decode, disk full or any I/O error returns False and is counted; only
  `ColdContractViolation` (a read from inside a decode step, a programming error) is
  raised, after it is counted in `reads_in_decode`.
- Disk full, a directory not writable, or `max_consecutive_write_errors` failures in a
  row suspend writes (`healthy` False, with a `reason`; reads of existing blocks keep
  working) until a probe on the tier's own thread succeeds (recovery.py).
- One server per root: the tier holds `<root>/tierguard.lock` (an flock, owner.py) from
  start to `close`. A second tier on the same root, in any process or PID namespace,
  waits `lock_wait_s` for it (a predecessor still closing) and then fails with
  `DirInUse` (a TierguardError naming the holder), so two servers never delete each
  other's files in flight nor fill the directory past one budget.
- The index is rebuilt on start by scanning the directory, so saved prefixes survive a
  restart; temporary files (their writer is gone: the lock says so) and unreadable files
  are removed then.
- Budget: `capacity_bytes` covers this fingerprint's blocks and the files of other
  fingerprints' directories under the root (old models', old_dirs.py). When a write
  would pass it, old fingerprints' files go first, oldest first, then the least recently
  used blocks of this fingerprint.
- Time to live (`ttl_s`, `--kv-disk-ttl-s`): a sweeper thread removes blocks not written
  or read for that long (`expired`). A read hit touches the file's mtime, so the clock
  survives a restart and `tierguard kv purge --older-than` reads the same clock.
- At rest (`codec`, `--kv-encrypt-key-file`): with an encrypting codec, plaintext blocks
  of this fingerprint are removed at start (`plaintext_removed`); blocks sealed with an
  old key (a rotation) are read and resealed with the current key by the sweeper
  (`resealed`); a block no configured key opens is an `undecodable` miss that stays on
  disk for a reader with the right key: it keeps its name (a write of the same block is
  refused, so a wrong key never overwrites the right key's blocks) until the budget, the
  TTL or a purge removes it.

All file operations go through a directory fd opened with O_NOFOLLOW and use fixed file
names, so nothing is created outside the configured directory, even via symlinks.

A file is a block in the format of block_format.py, written through a `BlockCodec`
(identity unless one is configured). The tier is one `ColdMedium` (media.py), registered
as "disk": the engine and the connector reach it only through that interface.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierguard.common.stats import counter, gauge
from tierguard.kv.faults import FaultInjector
from tierguard.kv.guard import check_disk_read_allowed, decode_in_progress
from tierguard.kv.lru import EvictionPolicy, LRUPolicy
from tierguard.kv.media import Buffer, ColdMedium, KeyedBlocks, MediumContext, register_medium
from tierguard.kv.media import block_format as blk
from tierguard.kv.media.disk import format as fmt
from tierguard.kv.media.disk import owner
from tierguard.kv.media.disk.old_dirs import OldDirs, OldFile
from tierguard.kv.media.disk.recovery import WriteRecovery, stop_prober, suspend_reason
from tierguard.kv.media.disk.upkeep import DiskUpkeep, Sweeper, sweep_interval
from tierguard.kv.spec import is_fingerprint

_OPEN_FLAGS = fmt.OPEN_FLAGS
_COUNTERS = (
    "hits misses writes write_bytes read_bytes corrupt undecodable verify_mismatch io_errors write_errors "
    "evictions rejected_writes reads_in_decode cleaned_on_start expired resealed plaintext_removed"
    " writes_disabled writes_reenabled write_probes write_probe_failures old_fingerprint_removed"
).split()


@dataclass
class DiskBlocks(KeyedBlocks):
    medium = "disk"


@dataclass
class DiskTierStats:
    capacity_bytes: int = gauge("Disk KV tier budget in bytes.", name="bytes_capacity")
    used_bytes: int = gauge("Disk KV tier bytes in block files.", name="bytes_used")
    num_blocks: int = gauge("Block files in the disk tier.", name="blocks")
    hits: int = 0  # file reads that returned a whole block (the manager counts tier hits)
    misses: int = 0
    writes: int = counter("Block files written.")
    write_bytes: int = counter("Bytes written to block files.")
    read_bytes: int = counter("Bytes read from block files.")
    corrupt: int = counter("Block files with a bad checksum or header, removed.")
    undecodable: int = counter("Blocks the codec could not decode (e.g. another key); kept on disk.")
    verify_mismatch: int = counter(
        "Block files whose header names another block or model than the reader's tokens (forged or misnamed), removed."
    )
    io_errors: int = counter("Disk reads that failed with an I/O error.")
    write_errors: int = counter("Disk writes that failed.")
    evictions: int = counter("Block files removed to stay within the budget.")
    rejected_writes: int = counter("Writes refused (disabled, or larger than the budget).")
    reads_in_decode: int = counter("Disk reads attempted inside a decode step (refused; a bug).")
    cleaned_on_start: int = counter("Leftover or torn files removed at start-up.")
    expired: int = counter("Block files removed by the TTL sweeper (not touched for --kv-disk-ttl-s).")
    resealed: int = counter("Blocks rewritten with the current key (a key rotation).")
    plaintext_removed: int = counter("Unencrypted block files removed at start (encryption is on).")
    undecodable_blocks: int = gauge("Block files kept that no configured key opens.")
    old_key_blocks: int = gauge("Block files sealed with an old key, waiting to be resealed.")
    writes_disabled: int = counter("Times writes were suspended (disk full, not writable, an error streak).")
    writes_reenabled: int = counter("Times writes resumed after a probe write succeeded.")
    write_probes: int = counter("Probe writes tried while writes were suspended.")
    write_probe_failures: int = counter("Probe writes that failed (writes stayed suspended).")
    old_fingerprint_bytes: int = gauge("Bytes of old fingerprints' directories, counted in the budget.")
    old_fingerprint_dirs: int = gauge("Old fingerprints' directories under the tier's root.")
    old_fingerprint_removed: int = counter("Files of old fingerprints removed to stay within the budget.")
    healthy: bool = gauge("1 while the disk tier is healthy.", default=True)
    writes_enabled: bool = True
    reason: str = ""


class DiskTier(DiskUpkeep, WriteRecovery, ColdMedium):
    name = "disk"
    spec = DiskBlocks

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: str,
        capacity_bytes: int,
        *,
        faults: FaultInjector | None = None,
        codec: blk.BlockCodec = blk.IDENTITY,
        policy: EvictionPolicy | None = None,
        max_consecutive_write_errors: int = 3,
        ttl_s: float = 0.0,
        sweep_interval_s: float | None = None,
        probe_interval_s: float = 1.0,
        probe_max_interval_s: float = 60.0,
        lock_wait_s: float = 15.0,
    ) -> None:
        """Open (or create) `<root>/<fingerprint>/`, take the root's lock, rebuild the index.
        Raises `owner.DirInUse` if another live process holds the root; every other problem
        leaves the tier unhealthy with a `reason`, never an exception."""
        if not is_fingerprint(fingerprint):
            raise ValueError(f"fingerprint must be 16 lowercase hex chars, got {fingerprint!r}")
        self.root = os.path.realpath(os.fspath(root))
        self.fingerprint = fingerprint
        self.capacity_bytes = int(capacity_bytes)
        self.faults = faults or FaultInjector()
        self.codec = codec
        self.max_consecutive_write_errors = max_consecutive_write_errors
        self.healthy = True
        self.writes_enabled = True
        self.reason = ""
        self._lock = threading.Lock()
        self._index: dict[int, int] = {}  # hash -> file bytes
        self._lru: EvictionPolicy = policy if policy is not None else LRUPolicy()  # every indexed block
        self._used = 0
        self._reserved = 0  # bytes of writes in flight, counted against the budget
        self._seq = itertools.count()
        self._consecutive_write_errors = 0
        self._c = dict.fromkeys(_COUNTERS, 0)
        self.ttl_s = float(ttl_s)
        self._touched: dict[int, float] = {}  # hash -> wall-clock time of the last write or read hit
        self._undecodable: set[int] = set()  # kept, never read again, never overwritten
        self._old_key: set[int] = set()  # readable, sealed with an old key: to reseal
        self.probe_interval_s = float(probe_interval_s)
        self.probe_max_interval_s = max(self.probe_interval_s, float(probe_max_interval_s))
        self._probe_wait = self.probe_interval_s
        self._probe_bytes = 0  # the size of the last write that failed: what a probe writes
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()
        self._dir_fd: int | None = None
        self._owner_fd: int | None = None
        unlocked = self._open_dir(lock_wait_s)
        self._old = OldDirs(self.root if self._owner_fd is not None else None, fingerprint)
        self._finalizer = weakref.finalize(self, _release, self._dir_fd, self._owner_fd, self._old)
        if self._dir_fd is not None and unlocked:
            self._rebuild_index(remove=False)  # not ours to clean: reads only
            self._disable(unlocked)
        elif self._dir_fd is not None:
            self._rebuild_index()
            self._probe_writable()
            self._enforce_budget()
        self._sweeper: Sweeper | None = None
        if self._dir_fd is not None and (self.ttl_s > 0 or self._old_key):
            interval = sweep_interval(self.ttl_s, sweep_interval_s)
            self._sweeper = Sweeper(self.housekeep, interval, f"kv-disk-sweeper-{fingerprint}")

    # ---- start-up ----

    def _disable(self, reason: str) -> None:
        self.healthy = False
        self.writes_enabled = False
        self.reason = reason

    def _open_dir(self, lock_wait_s: float) -> str:
        """Open the directory and take the root's lock; "" or, when the root can be read but
        not locked (a read-only volume of saved blocks), why the tier only reads."""
        path = os.path.join(self.root, self.fingerprint)
        unlocked = ""
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            try:
                self._owner_fd = owner.hold_dir(self.root, self.fingerprint, lock_wait_s)
            except OSError as e:
                if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT):
                    raise
                unlocked = f"cannot lock {self.root}/{owner.LOCK_NAME} ({e.strerror}); reads only"
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            self._dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
        except OSError as e:
            if self._owner_fd is not None:
                os.close(self._owner_fd)
                self._owner_fd = None
            reason = "symlinked tier directory refused" if e.errno in (errno.ELOOP, errno.ENOTDIR) else str(e)
            self._disable(f"cannot open {path}: {reason}")
        return unlocked

    def _rebuild_index(self, remove: bool = True) -> None:
        blocks, leftovers = fmt.scan_dir(self._dir_fd, self.fingerprint)
        if remove:
            for name in leftovers:
                self._unlink(name)
            self._c["cleaned_on_start"] += len(leftovers)
        encrypting = self.codec.codec_id != blk.IDENTITY_CODEC
        for f in blocks:  # oldest first: the LRU order survives a restart
            if encrypting and f.header.codec == blk.IDENTITY_CODEC:
                if remove:
                    self._unlink(fmt.block_name(f.block_hash))  # encryption is on: no plaintext stays
                    self._c["plaintext_removed"] += 1
                continue
            self._index[f.block_hash] = f.size
            self._lru.insert(f.block_hash)
            self._touched[f.block_hash] = f.mtime
            self._used += f.size
            if blk.sealed_with_old_key(self.codec, f.header):
                self._old_key.add(f.block_hash)

    def _probe_writable(self) -> None:
        name = fmt.temp_name(0, os.getpid(), next(self._seq))
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600, dir_fd=self._dir_fd)
            os.close(fd)
            os.unlink(name, dir_fd=self._dir_fd)
        except OSError as e:
            with self._lock:
                self._suspend_locked(f"directory not writable ({e.strerror or e})")

    def _enforce_budget(self) -> None:
        with self._lock:
            victims = self._evict_locked(0)
        self._drop(victims)

    # ---- queries ----

    def contains(self, block_hash: int) -> bool:
        """Index lookup only (no I/O), so it is safe anywhere, including inside decode.
        A block found undecodable is not offered again."""
        with self._lock:
            return block_hash in self._index and block_hash not in self._undecodable

    def payload_len(self, block_hash: int) -> int | None:
        """Bytes a read of this block fills (the codec's input length), None if absent."""
        with self._lock:
            size = None if block_hash in self._undecodable else self._index.get(block_hash)
        if size is None:
            return None
        return size - fmt.HEADER_LEN - (self.codec.stored_len(0))

    # ---- writes ----

    def write(self, block_hash: int, payload: Buffer) -> bool:
        """Store one block durably; False (counted) when it could not be stored."""
        return self.write_many([(block_hash, payload)])[0]

    def write_many(self, items: list[tuple[int, Buffer]]) -> list[bool]:
        """Store several blocks, each atomically, with one directory fsync for the batch."""
        results = [self._write_one(h, fmt.as_buffer(p)) for h, p in items]
        if any(results):
            try:
                os.fsync(self._dir_fd)
            except OSError:
                pass  # the files are whole; at worst a crash forgets a rename (a miss)
        return results

    def _write_one(self, block_hash: int, payload: memoryview) -> bool:
        blk.check_hash(block_hash)
        size = fmt.HEADER_LEN + self.codec.stored_len(payload.nbytes)
        with self._lock:
            if not self.writes_enabled or self._dir_fd is None or size > self.capacity_bytes:
                self._c["rejected_writes"] += 1
                return False
            if block_hash in self._undecodable:
                self._c["rejected_writes"] += 1  # another key's block keeps its name
                return False
            if block_hash in self._index:
                return True  # same (fingerprint, hash) means same bytes
            victims = self._evict_locked(size)
            self._reserved += size
        self._drop(victims)
        try:
            self._store_file(block_hash, payload)
        except OSError as e:
            self._record_write_error(e, size)
            return False
        with self._lock:
            self._reserved -= size
            # A concurrent write of the same block may have landed first; the rename
            # replaced its file, so count the bytes once.
            self._used += size - self._index.pop(block_hash, 0)
            self._index[block_hash] = size
            self._lru.insert(block_hash)
            self._touched[block_hash] = time.time()
            self._consecutive_write_errors = 0
            self._probe_wait = self.probe_interval_s  # writes work: the next suspension probes soon
            self._c["writes"] += 1
            self._c["write_bytes"] += size
        return True

    def _store_file(self, block_hash: int, payload: memoryview) -> None:
        """Encode and write one block file atomically (temp file, fdatasync, rename)."""
        tmp = fmt.temp_name(block_hash, os.getpid(), next(self._seq))
        mv = self.codec.encode(payload, blk.associated_data(self.fingerprint, block_hash))
        header = blk.encode_header(blk.header_for(self.fingerprint, block_hash, mv, self.codec))
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
        except OSError:
            self._unlink(tmp)
            raise

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
            self._probe_bytes = size
            why = suspend_reason(e, self._consecutive_write_errors, self.max_consecutive_write_errors)
            if why is not None:
                self._suspend_locked(why)

    def _evict_locked(self, incoming: int) -> list[int | OldFile]:
        """Take files off the count until `incoming` bytes fit: old fingerprints' files
        oldest first, then this fingerprint's LRU blocks; the caller `_drop`s them."""
        victims: list[int | OldFile] = []
        while self._used + self._old.bytes + self._reserved + incoming > self.capacity_bytes:
            old = self._old.pop_oldest()
            if old is not None:
                victims.append(old)
                self._c["old_fingerprint_removed"] += 1
                continue
            h = self._lru.pop_victim() if self._index else None
            if h is None:
                break
            self._forget_locked(h)
            victims.append(h)
            self._c["evictions"] += 1
        return victims

    def _drop(self, victims: list[int | OldFile]) -> None:
        """Unlink what `_evict_locked` took off the count (outside the lock)."""
        self._old.remove([v for v in victims if isinstance(v, OldFile)])
        for v in victims:
            if isinstance(v, int):
                self._unlink(fmt.block_name(v))

    def _forget_locked(self, block_hash: int) -> int | None:
        """Drop a block from every index (not the LRU, which the caller handles); its size."""
        size = self._index.pop(block_hash, None)
        if size is not None:
            self._used -= size
        self._touched.pop(block_hash, None)
        self._undecodable.discard(block_hash)
        self._old_key.discard(block_hash)
        return size

    # ---- reads ----

    def read_into(self, block_hash: int, out: Buffer) -> bool:
        """Fill `out` with the block's payload; False (counted) on any kind of miss.

        Raises ColdContractViolation (after counting it) when called from inside a decode
        step: the cold contract's enforcement.
        """
        return self.read_many([(block_hash, out)])[0]

    def read_many(self, items: list[tuple[int, Buffer]], ahead: int = 4) -> list[bool]:
        """Read several blocks in order, asking the kernel for the next `ahead` files while
        reading the current one. Per-file reads otherwise wait for each file's first I/O
        with nothing queued behind it, which makes single-threaded cold reads slow."""
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
        """Count, then refuse, a read from inside a decode step."""
        if not decode_in_progress():
            return
        with self._lock:
            self._c["reads_in_decode"] += n
        check_disk_read_allowed(f"{n} block(s)")

    def _open_block(self, block_hash: int, prefetch: bool) -> tuple[int | None, str]:
        """(fd, "") or (None, counter naming the miss)."""
        with self._lock:
            if block_hash not in self._index or block_hash in self._undecodable:
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

    def _finish_read(
        self, block_hash: int, opened: tuple[int | None, str], dst: memoryview, use: bool = True
    ) -> bool:
        """Read, verify and decode one opened block into `dst`. `use`: a read hit moves the
        block up the LRU and touches its mtime (False for the sweeper's own reads)."""
        fd, why = opened
        if fd is None:
            if why == "absent":
                with self._lock:
                    self._c["misses"] += 1
                return False
            return self._miss(block_hash, why, unlink=False)
        codec = self.codec
        # "" | "corrupt" or "verify_mismatch" (removed) | "undecodable" (kept: another key or codec may read it)
        why = ""
        try:
            head = bytearray(fmt.HEADER_LEN)
            direct = codec.codec_id == blk.IDENTITY_CODEC
            # Identity: the stored bytes are the payload, read straight into `dst`.
            stored = dst if direct else memoryview(bytearray(codec.stored_len(dst.nbytes)))
            whole = fmt.read_all(fd, memoryview(head), stored)  # one I/O for header and payload
            header = blk.decode_header(head)
            if not blk.identity_matches(header, self.fingerprint, block_hash):
                why = "verify_mismatch"  # made from other tokens or by another model: never served
            elif header.codec != codec.codec_id:
                why = "undecodable"
            elif not (
                whole
                and os.fstat(fd).st_size == fmt.HEADER_LEN + stored.nbytes
                and blk.verify(header, self.fingerprint, block_hash, stored)
            ):
                why = "corrupt"
            elif not direct:
                aad = blk.associated_data(self.fingerprint, block_hash)
                why = "" if codec.decode(stored, aad, dst, header.key_id) else "undecodable"
            if use and not why:
                fmt.touch(fd)
        except blk.BadHeader:
            why = "corrupt"
        except OSError:
            return self._miss(block_hash, "io_errors", unlink=False)
        finally:
            os.close(fd)
        if why:
            return self._miss(block_hash, why, unlink=why in ("corrupt", "verify_mismatch"))
        with self._lock:
            self._c["hits"] += 1
            self._c["read_bytes"] += fmt.HEADER_LEN + dst.nbytes
            if use:
                self._lru.touch(block_hash)
                if block_hash in self._touched:
                    self._touched[block_hash] = time.time()
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
            if counter == "undecodable" and block_hash in self._index:
                # Another key's block: it stays indexed (its bytes count against the
                # budget; LRU, TTL and purge can remove it) but is never offered again.
                self._undecodable.add(block_hash)
            elif self._forget_locked(block_hash) is not None:
                self._lru.remove(block_hash)
        if unlink:
            self._unlink(fmt.block_name(block_hash))
        return False

    # ---- housekeeping ----

    def remove(self, block_hash: int) -> bool:
        with self._lock:
            size = self._forget_locked(block_hash)
            if size is not None:
                self._lru.remove(block_hash)
        if size is not None:
            self._unlink(fmt.block_name(block_hash))
        return size is not None

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except OSError:
            pass

    def close(self) -> None:
        """Stop the tier's threads and let go of the directory and its lock."""
        stop_prober(self)
        if self._sweeper is not None:
            self._sweeper.stop()
            self._sweeper = None
        self._finalizer()  # closes the descriptors once, here or when the tier is collected
        self._dir_fd = self._owner_fd = None

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=self._used,
                num_blocks=len(self._index),
                healthy=self.healthy,
                writes_enabled=self.writes_enabled,
                reason=self.reason,
                undecodable_blocks=len(self._undecodable),
                old_key_blocks=len(self._old_key),
                old_fingerprint_bytes=self._old.bytes,
                old_fingerprint_dirs=self._old.num_dirs,
                **self._c,
            )


def _release(dir_fd: int | None, owner_fd: int | None, old: OldDirs) -> None:
    old.close()
    for fd in (dir_fd, owner_fd):  # the lock last: nothing is in flight once it goes
        if fd is not None:
            os.close(fd)


def _create(ctx: MediumContext, options: Mapping[str, Any]) -> DiskTier:
    """Options: `dir` (the tier's root directory), `capacity_bytes`, `ttl_s` (0: no TTL)."""
    return DiskTier(
        options["dir"],
        ctx.fingerprint,
        int(options["capacity_bytes"]),
        faults=ctx.faults,
        codec=ctx.codec,
        ttl_s=float(options.get("ttl_s", 0.0)),
    )


register_medium("disk", _create)
