"""Ownership by lock: who may delete what in a directory other processes also use.

A live owner is known by the `flock` it holds on a file, never by a pid. A pid means
nothing in another PID namespace (containers sharing /dev/shm with `--ipc=host`, or one
NVMe directory) and is reused; a lock is kept by the kernel for as long as one
descriptor of it is open, and dropped however its holder ends (kill -9 included), so
"nobody holds the lock" is exactly "the owner is gone". PostgreSQL's `postmaster.pid`
works the same way.

`flock`, not `fcntl`/`lockf`: POSIX record locks belong to the process, vanish when any
descriptor of the file is closed (a `torch.from_file`, a reader opening the file) and do
not conflict between two opens in one process; `flock` locks belong to the open file
description, so they survive other opens and conflict between two opens anywhere. A
descriptor made by `dup` or inherited over `fork` shares the lock (an `mmap` of the file
holds one: the lock lives exactly as long as the mapping).

- `hold_dir`: the lock of a directory (`<dir>/tierguard.lock`), held for the owner's
  life; a second owner waits a little (a predecessor still closing) and then fails with
  `DirInUse`, naming the holder from the record the holder wrote into the file.
- `claim`: the lock of a file found in a directory, if nobody holds it, after checking
  the name still refers to the locked file: the safe way to delete a stale one.
- `lock_new`: lock a file just created, so that it is never seen unlocked for longer than
  a stale-file reclaimer can take it (and if one did, start again).

Pids still appear in names and records, for people; `parse_pid` reads them with bounds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator

from tierguard.common.errors import TierguardError

LOCK_NAME = "tierguard.lock"
MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT: no pid is larger
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class DirInUse(TierguardError):
    """Another live process holds the directory's lock."""


def parse_pid(text: str) -> int | None:
    """A pid written as decimal ASCII digits, or None if it is not one (out of range too)."""
    if not (text.isascii() and text.isdigit()) or len(text) > 7:
        return None
    pid = int(text)
    return pid if 0 < pid <= MAX_PID else None


def try_lock(fd: int) -> bool:
    """Take an exclusive lock without waiting; False if another open file description has it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _same_file(fd: int, name: str, dir_fd: int | None) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def lock_new(fd: int, name: str, dir_fd: int | None = None) -> bool:
    """Lock a file this process just created as `name`; False if a reclaimer removed it
    first (the caller creates it again). Waits only while a reclaimer checks it."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    return _same_file(fd, name, dir_fd)


@contextlib.contextmanager
def claim(dir_fd: int, name: str) -> Iterator[bool]:
    """Yield True, holding its lock, if nobody holds the lock of `dir_fd/name` and the name
    still refers to that file; False otherwise (a live owner, gone, not ours to open)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _FLAGS, dir_fd=dir_fd)
    except OSError:
        yield False
        return
    try:
        yield try_lock(fd) and _same_file(fd, name, dir_fd)
    finally:
        os.close(fd)


def _record(fingerprint: str) -> bytes:
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rec = {"pid": os.getpid(), "host": socket.gethostname(), "fingerprint": fingerprint, "since": since}
    return (json.dumps(rec) + "\n").encode()


def describe_holder(path: str) -> str:
    """Who holds a directory lock, from the record it wrote ("unknown" if unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | _FLAGS)
        try:
            rec = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
        finally:
            os.close(fd)
        pid = parse_pid(str(rec.get("pid", "")))
        host = str(rec.get("host", "?"))[:64]
        fp, since = str(rec.get("fingerprint", "?"))[:16], str(rec.get("since", "?"))[:32]
    except (OSError, ValueError, AttributeError):
        return "an unknown process"
    return f"pid {pid if pid else '?'} on host {host!r} (fingerprint {fp}, since {since})"


def hold_dir(root: str, fingerprint: str, wait_s: float) -> int:
    """Take `<root>/tierguard.lock` for this process's life: the descriptor (close it to let
    go). Raises DirInUse, naming the holder, if another process keeps it past `wait_s`;
    OSError if the file cannot be opened or locked. In a directory this process may not
    write, an existing lock file is still locked (read-only), without a record."""
    path = os.path.join(root, LOCK_NAME)
    try:
        fd, writable = os.open(path, os.O_RDWR | os.O_CREAT | _FLAGS, 0o600), True
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        fd, writable = os.open(path, os.O_RDONLY | _FLAGS), False  # FileNotFoundError: cannot lock
    try:
        deadline = time.monotonic() + max(0.0, wait_s)
        while not try_lock(fd):
            if time.monotonic() >= deadline:
                raise DirInUse(
                    f"the KV disk directory {root} is in use by {describe_holder(path)}: "
                    "one server per directory; give this one its own --kv-disk-dir (kv_disk_dir)"
                )
            time.sleep(0.05)
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, _record(fingerprint), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def dir_free(root: str) -> Iterator[bool]:
    """Yield True, holding the directory's lock, if no process holds it (nothing of a live
    server is in flight under `root`); False while one does."""
    try:  # created if absent, so that a server starting meanwhile waits for it
        fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDONLY | os.O_CREAT | _FLAGS, 0o600)
    except OSError:
        yield False
        return
    try:
        yield try_lock(fd)
    finally:
        os.close(fd)
