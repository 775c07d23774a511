"""Block files of the disk tier: names, the directory scan, and raw file I/O.

`<root>/<fingerprint>/<hash:064x>.kvb` holds one block in the medium-neutral format of
tierguard/kv/media/block_format.py (128-byte header, then the stored bytes); the name is the
block's whole 256-bit hash. Temporary files are `.tmp-<low 64 bits of the hash:016x>-<pid>-<seq>`.
Only the holder of the directory's lock (owner.py) writes under it, so a temporary file found
by the next holder is a leftover of a kill -9, whatever the pid in its name says (pids repeat
and mean nothing across PID namespaces); the pid is for people, and a name whose pid or
sequence is out of range is not one of ours.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierguard.kv.media.block_format import HEADER_LEN, U64_MAX, BadHeader, Header, decode_header
from tierguard.kv.media.disk.owner import parse_pid

if TYPE_CHECKING:
    import torch

__all__ = [
    "HEADER_LEN",
    "U64_MAX",
    "OPEN_FLAGS",
    "block_name",
    "temp_name",
    "is_temp_name",
    "as_buffer",
    "read_all",
    "scan_dir",
    "BlockFile",
]

OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC  # never follow a symlink planted in the tier directory

BLOCK_RE = re.compile(r"^([0-9a-f]{64})\.kvb$")
# Block files of the previous format (64-bit names). Every fingerprint changed with the
# format, so they sit only in old fingerprints' directories, where old_dirs.py counts them.
PREVIOUS_BLOCK_RE = re.compile(r"^[0-9a-f]{16}\.kvb$")
TEMP_RE = re.compile(r"^\.tmp-([0-9a-f]{16})-([0-9]{1,7})-([0-9]{1,19})$")


def block_name(block_hash: int) -> str:
    return f"{block_hash:064x}.kvb"


def temp_name(block_hash: int, pid: int, seq: int) -> str:
    return f".tmp-{block_hash & U64_MAX:016x}-{pid}-{seq}"


def as_buffer(obj: torch.Tensor | bytes | bytearray | memoryview) -> memoryview:
    import torch  # here, not at import: `tierguard kv purge` reads these files without torch

    if isinstance(obj, torch.Tensor):
        if obj.dtype != torch.uint8 or obj.device.type != "cpu" or not obj.is_contiguous():
            raise ValueError("disk tier payloads must be contiguous CPU uint8 tensors")
        return memoryview(obj.numpy()).cast("B")
    return memoryview(obj).cast("B")


def touch(fd: int) -> None:
    """Set an open block file's mtime to now: a read hit is a use (TTL, purge --older-than)."""
    try:
        os.utime(fd)
    except OSError:
        pass  # only the clock of the TTL; the block itself is fine


def is_temp_name(name: str) -> bool:
    """A temporary file name this tier writes (pid and sequence within their bounds)."""
    m = TEMP_RE.match(name)
    return bool(m) and parse_pid(m.group(2)) is not None and int(m.group(3)) <= U64_MAX


def read_all(fd: int, head: memoryview, dst: memoryview) -> bool:
    """Read header and payload with vectored preads; False if the file is shorter."""
    views, offset = [head, dst], 0
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            return False
        offset += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views:
            views[0] = views[0][n:]
    return True


@dataclass(frozen=True)
class BlockFile:
    """An intact block file found by a scan: its hash, size, last touch and header."""

    block_hash: int
    size: int
    mtime: float  # last write or read hit (reads touch the file): the TTL and LRU clock
    header: Header


def validate_file(dir_fd: int, name: str, fingerprint: str, block_hash: int) -> Header | None:
    """The header if it is intact and matches the name and file length, else None.

    Reads only the header (start-up must stay fast); payload checksums are verified on read.
    """
    try:
        fd = os.open(name, os.O_RDONLY | OPEN_FLAGS, dir_fd=dir_fd)
        try:
            header = decode_header(os.pread(fd, HEADER_LEN, 0))
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
    except (OSError, BadHeader):
        return None
    if header.fingerprint != fingerprint or header.block_hash != block_hash:
        return None
    if size != HEADER_LEN + header.payload_len:
        return None
    return header


def scan_dir(dir_fd: int, fingerprint: str) -> tuple[list[BlockFile], list[str]]:
    """Scan a tier directory: (intact blocks oldest first, names to remove).

    The caller holds the directory's lock, so no writer of the temporary files is alive.
    To remove: those temporary files (a kill -9 mid-write) and block files with a torn,
    foreign or truncated header. Names that are not ours and symlinks are neither listed
    nor removed.
    """
    found: list[BlockFile] = []
    leftovers: list[str] = []
    for entry in os.scandir(dir_fd):
        if is_temp_name(entry.name):
            if entry.is_file(follow_symlinks=False):
                leftovers.append(entry.name)
            continue
        m = BLOCK_RE.match(entry.name)
        if not m or not entry.is_file(follow_symlinks=False):
            continue
        block_hash = int(m.group(1), 16)
        header = validate_file(dir_fd, entry.name, fingerprint, block_hash)
        if header is None:
            leftovers.append(entry.name)
            continue
        mtime = entry.stat(follow_symlinks=False).st_mtime
        found.append(BlockFile(block_hash, HEADER_LEN + header.payload_len, mtime, header))
    found.sort(key=lambda f: (f.mtime, f.block_hash))
    return found, leftovers
