"""The host-RAM slab both vLLM processes map: the scheduler's tiers stage blocks into it, the
worker copies them between it and the KV cache.

vLLM runs the scheduler side of a connector in the engine-core process and the worker
side in each worker process (on CPU always a separate process), and they talk only
through step metadata. The host tier's bytes must therefore live in memory both can map:
one file in a tmpfs directory (`host_shm_dir`, /dev/shm by default), created and sized by
the scheduler side, named after the engine and the creating process (and a random part), mapped shared by
the worker on first use. The bookkeeping (which slot holds which block) stays with the
scheduler's `HostTier`; the worker only ever touches the slots a step names.

The scheduler side removes the file as soon as the worker reports it mapped (the memory
lives on in both mappings and is freed when both processes end, however they end).

- Room is taken at start: the file is allocated whole (`posix_fallocate`), so a tmpfs too
  small for `kv_host_gib` (Docker's /dev/shm is 64 MiB unless `--shm-size` says more) is
  a one-line `TierguardError` naming its size and free space when the connector starts,
  never a SIGBUS in the middle of a run when a page of a sparse file finds no memory.
- Ownership is a lock, not a pid: the creator holds a `flock` on the file for as long as
  its mapping lives (owner.py), so a file left by an engine killed before its first
  transfer, and only such a file, is removed by the next one that starts in the same
  directory, in whatever PID namespace (containers sharing /dev/shm see each other's
  files but not each other's pids). The pid in the name is for people and is never
  parsed. One worker per engine (tensor parallel 1).
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from pathlib import Path

import torch

from tierguard.common.errors import TierguardError
from tierguard.kv.media.disk import owner

PREFIX = "tierguard-kv-"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
# <engine>-<pid>[-<random>]: the names slab_path makes (older ones had no random part)
_NAME = re.compile(r"^tierguard-kv-[A-Za-z0-9_.-]{1,64}-([0-9]{1,7})(?:-[0-9a-f]{8})?$")


def is_slab_name(name: str) -> bool:
    """A name `slab_path` makes, its pid within bounds; any other name is not ours."""
    m = _NAME.match(name)
    return bool(m) and owner.parse_pid(m.group(1)) is not None


def slab_path(directory: str, engine_id: str, creator_pid: int) -> Path:
    """A new slab's name: the engine, the creator's pid and a random part (pids repeat
    across PID namespaces, and so may engine ids)."""
    return Path(directory) / f"{PREFIX}{_SAFE.sub('_', engine_id)[:64]}-{creator_pid}-{secrets.token_hex(4)}"


def remove_stale(directory: str) -> int:
    """Remove slabs no live process owns (nobody holds their lock); returns how many.
    Files of another user, symlinks and names `slab_path` does not make (a pid out of
    range included) are left alone."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0
    removed = 0
    try:
        for entry in os.scandir(dir_fd):
            if not is_slab_name(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            with owner.claim(dir_fd, entry.name) as stale:
                if stale:
                    try:
                        os.unlink(entry.name, dir_fd=dir_fd)
                        removed += 1
                    except OSError:
                        pass
    finally:
        os.close(dir_fd)
    return removed


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 1000 * 2**20 else f"{n / 2**20:.1f} MiB"  # 1 GiB of whole rows: 1.0 GiB


def free_bytes(directory: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(free, total) bytes of the filesystem holding `directory`; None if it reports no
    size (a tmpfs mounted without a limit)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    if st.f_blocks == 0:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def no_room_message(directory: str | os.PathLike[str], size: int) -> str:
    room = free_bytes(directory)
    has = f", which has {_size(room[0])} free of {_size(room[1])}" if room else ""
    return (
        f"TierguardConnector: the host slab (kv_host_gib) needs {_size(size)} of shared memory in "
        f"{directory}{has}: give the container more shared memory (docker run --shm-size, "
        "a larger tmpfs at host_shm_dir) or lower kv_host_gib"
    )


def create_slab(path: Path, num_slots: int, block_bytes: int) -> torch.Tensor:
    """A zero-filled shared slab of `num_slots` rows (mode 0600, refused if it exists),
    allocated whole and owned (locked) by this process for as long as the tensor lives.
    TierguardError, one line, if it does not fit or cannot be made."""
    size = num_slots * block_bytes
    if size <= 0:
        raise ValueError(f"a host slab needs at least one byte, got {num_slots} x {block_bytes}")
    room = free_bytes(path.parent)
    if room is not None and size > room[0]:
        raise TierguardError(no_room_message(path.parent, size))
    for _ in range(3):  # a reclaimer may take a new file before its lock: make it again
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise TierguardError(
                f"TierguardConnector: cannot create the host slab {path}: {e.strerror}"
            ) from None
        try:
            if not owner.lock_new(fd, str(path)):
                continue
            return _allocate_and_map(fd, path, num_slots, block_bytes)
        finally:
            os.close(fd)  # the mapping keeps its own descriptor, and with it the lock
    raise TierguardError(f"TierguardConnector: the host slab {path} was removed as it was made, three times")


def _allocate_and_map(fd: int, path: Path, num_slots: int, block_bytes: int) -> torch.Tensor:
    size = num_slots * block_bytes
    try:
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size)  # shared, read-write; dup()s fd, so the lock lives with it
    except OSError as e:
        try:
            os.unlink(path)
        except OSError:
            pass
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise TierguardError(no_room_message(path.parent, size)) from None
        raise TierguardError(
            f"TierguardConnector: cannot allocate the host slab {path} ({_size(size)}): {e.strerror or e}"
        ) from None
    return torch.frombuffer(mapping, dtype=torch.uint8).view(num_slots, block_bytes)


def open_slab(path: Path, num_slots: int, block_bytes: int) -> torch.Tensor:
    """Map a slab the scheduler side created (the worker side)."""
    size = num_slots * block_bytes
    try:
        actual = os.stat(path).st_size
    except OSError as e:
        raise TierguardError(f"TierguardConnector: the host slab {path} is missing: {e.strerror}") from None
    if actual != size:
        raise TierguardError(f"TierguardConnector: the host slab {path} has {actual} bytes, expected {size}")
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8).view(num_slots, block_bytes)
