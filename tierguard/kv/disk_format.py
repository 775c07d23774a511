"""On-disk format of one block file, file names, and the raw file I/O the disk tier uses.

Layout of `<root>/<fingerprint>/<hash:016x>.kvb`:

    offset  size  field
    0       4     magic b"TGKV"
    4       2     format version (1)
    6       2     header length (64)
    8       16    fingerprint, ASCII hex
    24      8     block hash (u64)
    32      8     payload length in bytes (u64)
    40      8     xxh3-64 of the payload
    48      8     xxh3-64 of bytes 0..47 (a torn header fails here)
    56      8     reserved, zero
    64      ...   payload (the block's bytes as the host tier holds them)

The payload starts on a 64-byte boundary so it can be read straight into a slot.
Temporary files are `.tmp-<hash:016x>-<pid>-<seq>`; a dead writer's pid marks them as
leftovers of a kill -9 that the next start removes.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

import torch
import xxhash

MAGIC = b"TGKV"
VERSION = 1
HEADER_LEN = 64
_HEAD = struct.Struct("<4sHH16sQQQ")  # fields up to the header checksum (48 bytes)
_TAIL = struct.Struct("<QQ")  # header checksum, reserved
U64_MAX = 2**64 - 1
OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC  # never follow a symlink planted in the tier directory

BLOCK_RE = re.compile(r"^([0-9a-f]{16})\.kvb$")
TEMP_RE = re.compile(r"^\.tmp-([0-9a-f]{16})-(\d+)-(\d+)$")


@dataclass(frozen=True)
class Header:
    fingerprint: str
    block_hash: int
    payload_len: int
    payload_xxh3: int


class BadHeader(ValueError):
    """The header is torn, foreign or of another version; the file is not a usable block."""


def block_name(block_hash: int) -> str:
    return f"{block_hash:016x}.kvb"


def temp_name(block_hash: int, pid: int, seq: int) -> str:
    return f".tmp-{block_hash:016x}-{pid}-{seq}"


def encode_header(h: Header) -> bytes:
    head = _HEAD.pack(
        MAGIC, VERSION, HEADER_LEN, h.fingerprint.encode("ascii"), h.block_hash, h.payload_len, h.payload_xxh3
    )
    return head + _TAIL.pack(xxhash.xxh3_64_intdigest(head), 0)


def decode_header(raw: bytes) -> Header:
    if len(raw) < HEADER_LEN:
        raise BadHeader(f"short header ({len(raw)} bytes)")
    head = raw[: _HEAD.size]
    magic, version, header_len, fp, block_hash, payload_len, payload_xxh = _HEAD.unpack(head)
    (head_xxh, _reserved) = _TAIL.unpack(raw[_HEAD.size : HEADER_LEN])
    if magic != MAGIC:
        raise BadHeader("bad magic")
    if version != VERSION or header_len != HEADER_LEN:
        raise BadHeader(f"unsupported version {version} / header length {header_len}")
    if xxhash.xxh3_64_intdigest(head) != head_xxh:
        raise BadHeader("header checksum mismatch")
    return Header(
        fingerprint=fp.decode("ascii", "replace"),
        block_hash=block_hash,
        payload_len=payload_len,
        payload_xxh3=payload_xxh,
    )


def as_buffer(obj: torch.Tensor | bytes | bytearray | memoryview) -> memoryview:
    if isinstance(obj, torch.Tensor):
        if obj.dtype != torch.uint8 or obj.device.type != "cpu" or not obj.is_contiguous():
            raise ValueError("disk tier payloads must be contiguous CPU uint8 tensors")
        return memoryview(obj.numpy()).cast("B")
    return memoryview(obj).cast("B")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def validate_file(dir_fd: int, name: str, fingerprint: str, block_hash: int) -> int | None:
    """File size if the header is intact and matches the name and length, else None.

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
    return size


def scan_dir(dir_fd: int, fingerprint: str) -> tuple[list[tuple[int, int]], list[str]]:
    """Scan a tier directory: ((hash, size) of intact blocks oldest first, names to remove).

    To remove: temporary files whose writer is dead (a kill -9 mid-write) and block files
    with a torn, foreign or truncated header. Names that are not ours and symlinks are
    neither listed nor removed.
    """
    found: list[tuple[float, int, int]] = []
    leftovers: list[str] = []
    for entry in os.scandir(dir_fd):
        temp = TEMP_RE.match(entry.name)
        if temp:
            if not pid_alive(int(temp.group(2))):
                leftovers.append(entry.name)
            continue
        m = BLOCK_RE.match(entry.name)
        if not m or not entry.is_file(follow_symlinks=False):
            continue
        block_hash = int(m.group(1), 16)
        size = validate_file(dir_fd, entry.name, fingerprint, block_hash)
        if size is None:
            leftovers.append(entry.name)
            continue
        found.append((entry.stat(follow_symlinks=False).st_mtime, block_hash, size))
    return [(h, size) for _mtime, h, size in sorted(found)], leftovers
