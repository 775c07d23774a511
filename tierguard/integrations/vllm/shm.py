"""The host-RAM slab both vLLM processes map: the scheduler's tiers stage blocks into it, the
worker copies them between it and the KV cache.

vLLM runs the scheduler side of a connector in the engine-core process and the worker
side in each worker process (on CPU always a separate process), and they talk only
through step metadata. The host tier's bytes must therefore live in memory both can map:
one file in a tmpfs directory (`host_shm_dir`, /dev/shm by default), created and sized by
the scheduler side, named after the engine and the creating process, mapped shared by
the worker on first use. The bookkeeping (which slot holds which block) stays with the
scheduler's `HostTier`; the worker only ever touches the slots a step names.

The scheduler side removes the file as soon as the worker reports it mapped (the memory
lives on in both mappings and is freed when both processes end, however they end); a file
left by an engine killed before its first transfer is removed by the next one that starts
in the same directory (its creator is gone). One worker per engine (tensor parallel 1).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from tierguard.common.errors import TierguardError
from tierguard.kv.media.disk.format import pid_alive

PREFIX = "tierguard-kv-"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def slab_path(directory: str, engine_id: str, creator_pid: int) -> Path:
    return Path(directory) / f"{PREFIX}{_SAFE.sub('_', engine_id)[:64]}-{creator_pid}"


def remove_stale(directory: str) -> int:
    """Remove slabs whose creating process is gone; returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name.rpartition("-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError:
                pass
    return removed


def create_slab(path: Path, num_slots: int, block_bytes: int) -> torch.Tensor:
    """A zero-filled shared slab of `num_slots` rows (mode 0600, refused if it exists)."""
    size = num_slots * block_bytes
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as e:
        raise TierguardError(
            f"TierguardConnector: cannot create the host slab {path}: {e.strerror}"
        ) from None
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise TierguardError(
            f"TierguardConnector: cannot size the host slab {path} to {size} bytes: {e}"
        ) from None
    os.close(fd)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8).view(num_slots, block_bytes)


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
