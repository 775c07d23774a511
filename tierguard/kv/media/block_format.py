"""A stored block, medium-neutral: a 128-byte header, a checksum, and an optional codec.

Every cold medium (local disk, Redis) stores a block as `header + stored bytes`, where
the stored bytes are the payload passed through a `BlockCodec` (identity by default; an
AES-256-GCM codec encrypts them). The header names the block, so a reader can refuse a
foreign, torn, stale, misnamed or undecodable block and treat it as a miss:

    offset  size  field
    0       4     magic b"TGKV"
    4       2     format version (3)
    6       2     header length (128)
    8       16    fingerprint, ASCII hex (tierguard.kv.spec.fingerprint)
    24      32    block hash (256-bit, little-endian)
    56      8     stored length in bytes (u64)
    64      8     xxh3-64 of the stored bytes
    72      2     codec id (0: identity)
    74      2     reserved, zero
    76      4     key id (0 for the identity codec)
    80      40    reserved, zero
    120     8     xxh3-64 of bytes 0..119 (a torn header fails here)

The block hash is the whole SHA-256 chain value (tierguard/engine/prefix_hash.py): a
digest of the model's root, the request's cache salt and every token id up to the end of
the block. A reader serves a block only when the header's hash equals the one it computed
from its own token ids (`identity_matches`), so a block made from other tokens, or copied
under another name, is a miss (`verify_mismatch` in the tiers' counters), never wrong KV.
Blocks of an older format version fail `decode_header` and are misses too.

The payload starts on a 64-byte boundary, so with the identity codec it is read straight
into a host slot. The associated data a codec must bind is `associated_data(fp, hash)`:
a block copied under another name or fingerprint does not decode.

What the header cannot do without a key: the checksums are unkeyed, so whoever can write
to the medium can store garbage KV under a name it computed from tokens it knows. Only
an authenticating codec (`--kv-encrypt-key-file`) rules that out (docs/cold-contract.md).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

import xxhash

MAGIC = b"TGKV"
VERSION = 3
HEADER_LEN = 128
HASH_BYTES = 32  # tierguard.engine.prefix_hash.HASH_BYTES
_HEAD = struct.Struct("<4sHH16s32sQQHHI40x")  # fields up to the header checksum (120 bytes)
_TAIL = struct.Struct("<Q")
U64_MAX = 2**64 - 1
HASH_MAX = 2 ** (8 * HASH_BYTES) - 1
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
        h.block_hash.to_bytes(HASH_BYTES, "little"),
        h.payload_len,
        h.payload_xxh3,
        h.codec,
        0,
        h.key_id,
    )
    return head + _TAIL.pack(checksum(head))


def decode_header(raw: bytes | bytearray | memoryview) -> Header:
    raw = bytes(raw[:HEADER_LEN])
    if len(raw) < 8:
        raise BadHeader(f"short header ({len(raw)} bytes)")
    magic, version, header_len = struct.unpack_from("<4sHH", raw)
    if magic != MAGIC:
        raise BadHeader("bad magic")
    if version != VERSION or header_len != HEADER_LEN:  # an older format is a miss, never parsed
        raise BadHeader(f"unsupported version {version} / header length {header_len}")
    if len(raw) < HEADER_LEN:
        raise BadHeader(f"short header ({len(raw)} bytes)")
    head = raw[: _HEAD.size]
    _m, _v, _l, fp, block_hash, payload_len, payload_xxh, codec, _r, key_id = _HEAD.unpack(head)
    (head_xxh,) = _TAIL.unpack(raw[_HEAD.size : HEADER_LEN])
    if checksum(head) != head_xxh:
        raise BadHeader("header checksum mismatch")
    return Header(
        fp.decode("ascii", "replace"), int.from_bytes(block_hash, "little"), payload_len, payload_xxh, codec, key_id
    )


def is_fingerprint(text: str) -> bool:
    """16 lowercase hex characters (tierguard.kv.spec.fingerprint; a tier directory's name)."""
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def check_hash(block_hash: int) -> None:
    """Refuse a name that is not a block hash (an int in [0, 2**256))."""
    if not 0 <= block_hash <= HASH_MAX:
        raise ValueError(f"block hash must be an unsigned {8 * HASH_BYTES}-bit int, got {block_hash}")


def associated_data(fingerprint: str, block_hash: int) -> bytes:
    """What an authenticating codec binds a block's bytes to."""
    return fingerprint.encode("ascii") + block_hash.to_bytes(HASH_BYTES, "little")


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
    check_hash(block_hash)
    return Header(fingerprint, block_hash, stored.nbytes, checksum(stored), codec.codec_id, codec.key_id)


def identity_matches(header: Header, fingerprint: str, block_hash: int) -> bool:
    """Whether the block is the one the reader asked for: the same fingerprint and the
    same 256-bit hash, the digest of the reader's own token ids. False means a block made
    from other tokens (or by another model) sits under this name: a miss, never served."""
    return header.fingerprint == fingerprint and header.block_hash == block_hash


def verify(header: Header, fingerprint: str, block_hash: int, stored: memoryview) -> bool:
    """True if `stored` is the whole, intact block this header names, and that block is
    the reader's (`identity_matches`)."""
    return (
        identity_matches(header, fingerprint, block_hash)
        and header.payload_len == stored.nbytes
        and checksum(stored) == header.payload_xxh3
    )
