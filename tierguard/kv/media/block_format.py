"""A stored block, medium-neutral: a 64-byte header, a checksum, and an optional codec.

Every cold medium (local disk today; a remote store or an encrypted disk later) stores a
block as `header + stored bytes`, where the stored bytes are the payload passed through a
`BlockCodec` (identity by default; an AES-256-GCM codec encrypts them). The header names
the block, so a reader can refuse a foreign, torn, stale or undecodable block and treat
it as a miss:

    offset  size  field
    0       4     magic b"TGKV"
    4       2     format version (2)
    6       2     header length (64)
    8       16    fingerprint, ASCII hex (tierguard.kv.spec.fingerprint)
    24      8     block hash (u64)
    32      8     stored length in bytes (u64)
    40      8     xxh3-64 of the stored bytes
    48      2     codec id (0: identity)
    50      2     reserved, zero
    52      4     key id (0 for the identity codec)
    56      8     xxh3-64 of bytes 0..55 (a torn header fails here)

The payload starts on a 64-byte boundary, so with the identity codec it is read straight
into a host slot. The associated data a codec must bind is `associated_data(fp, hash)`:
a block copied under another name or fingerprint does not decode.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

import xxhash

MAGIC = b"TGKV"
VERSION = 2
HEADER_LEN = 64
_HEAD = struct.Struct("<4sHH16sQQQHHI")  # fields up to the header checksum (56 bytes)
_TAIL = struct.Struct("<Q")
U64_MAX = 2**64 - 1
IDENTITY_CODEC = 0


@dataclass(frozen=True)
class Header:
    fingerprint: str
    block_hash: int
    payload_len: int  # stored bytes after the header (the codec's output)
    payload_xxh3: int
    codec: int = IDENTITY_CODEC
    key_id: int = 0


class BadHeader(ValueError):
    """The header is torn, foreign or of another version; the block is not usable."""


def checksum(data: memoryview | bytes | bytearray) -> int:
    return xxhash.xxh3_64_intdigest(data)


def encode_header(h: Header) -> bytes:
    head = _HEAD.pack(
        MAGIC,
        VERSION,
        HEADER_LEN,
        h.fingerprint.encode("ascii"),
        h.block_hash,
        h.payload_len,
        h.payload_xxh3,
        h.codec,
        0,
        h.key_id,
    )
    return head + _TAIL.pack(checksum(head))


def decode_header(raw: bytes | bytearray | memoryview) -> Header:
    raw = bytes(raw)
    if len(raw) < HEADER_LEN:
        raise BadHeader(f"short header ({len(raw)} bytes)")
    head = raw[: _HEAD.size]
    magic, version, header_len, fp, block_hash, payload_len, payload_xxh, codec, _r, key_id = _HEAD.unpack(
        head
    )
    (head_xxh,) = _TAIL.unpack(raw[_HEAD.size : HEADER_LEN])
    if magic != MAGIC:
        raise BadHeader("bad magic")
    if version != VERSION or header_len != HEADER_LEN:
        raise BadHeader(f"unsupported version {version} / header length {header_len}")
    if checksum(head) != head_xxh:
        raise BadHeader("header checksum mismatch")
    return Header(fp.decode("ascii", "replace"), block_hash, payload_len, payload_xxh, codec, key_id)


def is_fingerprint(text: str) -> bool:
    """16 lowercase hex characters (tierguard.kv.spec.fingerprint; a tier directory's name)."""
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def associated_data(fingerprint: str, block_hash: int) -> bytes:
    """What an authenticating codec binds a block's bytes to."""
    return fingerprint.encode("ascii") + block_hash.to_bytes(8, "little")


class BlockCodec(Protocol):
    """Turns a payload into the bytes a medium stores, and back.

    `encode` may return its input unchanged (no copy). `decode` fills `out` (exactly the
    payload length) and returns False when the stored bytes cannot be decoded (wrong key,
    failed authentication): the caller counts a miss and recomputes, never an error.
    Optional, for keyed codecs: `readable(codec_id, key_id)` and `is_current(key_id)`
    (see `codec_can_read`, `sealed_with_old_key`); tierguard/kv/media/aead_codec.py has both.
    """

    codec_id: int
    key_id: int

    def stored_len(self, payload_len: int) -> int: ...

    def encode(self, payload: memoryview, aad: bytes) -> memoryview: ...

    def decode(self, stored: memoryview, aad: bytes, out: memoryview, key_id: int) -> bool: ...


class IdentityCodec:
    """Stores the payload as is (integrity from the header's checksum only)."""

    codec_id = IDENTITY_CODEC
    key_id = 0

    def stored_len(self, payload_len: int) -> int:
        return payload_len

    def encode(self, payload: memoryview, aad: bytes) -> memoryview:
        return payload

    def decode(self, stored: memoryview, aad: bytes, out: memoryview, key_id: int) -> bool:
        if stored.nbytes != out.nbytes:
            return False
        out[:] = stored
        return True

    def readable(self, codec_id: int, key_id: int) -> bool:
        return codec_id == IDENTITY_CODEC

    def is_current(self, key_id: int) -> bool:
        return True


IDENTITY = IdentityCodec()


def codec_can_read(codec: BlockCodec, header: Header) -> bool:
    """Whether `codec` holds what a block with this header needs (no I/O, no decryption).

    A keyed codec may say so with `readable(codec_id, key_id)` (the AES-GCM codec knows
    its current and old key ids); otherwise only the codec id is compared, and a wrong
    key shows up when `decode` fails.
    """
    readable = getattr(codec, "readable", None)
    return readable(header.codec, header.key_id) if readable else header.codec == codec.codec_id


def sealed_with_old_key(codec: BlockCodec, header: Header) -> bool:
    """A readable block sealed with a key other than the current one (a rotation's work)."""
    is_current = getattr(codec, "is_current", None)
    return is_current is not None and codec_can_read(codec, header) and not is_current(header.key_id)


def header_for(fingerprint: str, block_hash: int, stored: memoryview, codec: BlockCodec = IDENTITY) -> Header:
    """The header of `stored` (the codec's output), checksummed."""
    if not 0 <= block_hash <= U64_MAX:
        raise ValueError(f"block hash must be an unsigned 64-bit int, got {block_hash}")
    return Header(fingerprint, block_hash, stored.nbytes, checksum(stored), codec.codec_id, codec.key_id)


def verify(header: Header, fingerprint: str, block_hash: int, stored: memoryview) -> bool:
    """True if `stored` is the whole, intact block this header names."""
    return (
        header.fingerprint == fingerprint
        and header.block_hash == block_hash
        and header.payload_len == stored.nbytes
        and checksum(stored) == header.payload_xxh3
    )
