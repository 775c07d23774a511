"""AES-256-GCM envelopes for data at rest: async jobs of the gate today, cold KV blocks next.

Why an envelope rather than bare AES-GCM output:
- the header names the key (a key id derived from the key itself), so a reader holding
  the current key and a few old ones (a rotation in progress) picks the right key at
  once and tells "sealed with a key I do not have" apart from "damaged";
- the caller's associated data binds a blob to its place (a job id, a block hash and
  model fingerprint): a file copied under another name fails authentication instead of
  decrypting as somebody else's data;
- a failure of any kind is one exception, `DecryptError("cannot decrypt: ...")`, never
  plaintext and never a half-decrypted result (GCM checks the tag before returning).

Format (`seal`)::

    +--------+----------+-----------+---------------------------+
    | "TGE1" | key id   | nonce     | ciphertext || GCM tag     |
    | 4 B    | 8 B      | 12 B      | len(plaintext) + 16 B     |
    +--------+----------+-----------+---------------------------+

The nonce is random per seal (96 bits): keep well under 2^32 seals per key, which a
rotation now and then guarantees for job files and KV blocks alike.

Key files hold 32 bytes: raw, or as 64 hex characters, or as base64 (a trailing newline
is fine). Make one with `head -c 32 /dev/urandom > key && chmod 600 key` or
`openssl rand -hex 32 > key`. A key file that group or others can read is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tierguard.common.errors import TierguardError

MAGIC = b"TGE1"
KEY_BYTES = 32
KEY_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16
HEADER_BYTES = len(MAGIC) + KEY_ID_BYTES + NONCE_BYTES
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES


class DecryptError(Exception):
    """A blob that cannot be opened: unknown key, damaged, wrong place, or not sealed at all."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"cannot decrypt: {reason}")
        self.reason = reason


def key_id(secret: bytes) -> bytes:
    """8 bytes that name a key without revealing it (a hash of the key, domain-separated)."""
    return hashlib.sha256(b"tierguard key id\x00" + secret).digest()[:KEY_ID_BYTES]


@dataclass(frozen=True)
class Key:
    """One AES-256 key and its id; the secret never appears in repr or logs."""

    secret: bytes = field(repr=False)
    id: bytes = b""

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise TierguardError(f"an encryption key must be {KEY_BYTES} bytes, got {len(self.secret)}")
        object.__setattr__(self, "id", key_id(self.secret))

    @property
    def id_hex(self) -> str:
        return self.id.hex()

    @classmethod
    def from_file(cls, path: str | Path) -> Key:
        """Read a key file (raw 32 bytes, 64 hex characters or base64); refuse loose permissions."""
        return cls(_decode_key(read_private_file(path, "key file"), str(path)))


def read_private_file(path: str | Path, what: str) -> bytes:
    """The bytes of a file that holds secrets (an encryption key, the gate's API keys).

    Refused with a one-line TierguardError naming `what` and the path: unreadable, not a
    regular file (a FIFO is not waited on), or open to group or others in any way
    (the message gives the `chmod 600` that fixes it). The checks are made on the opened
    file, so a rename between check and read cannot swap it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise TierguardError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TierguardError(f"{what} {str(path)!r} is not a regular file")
        if st.st_mode & 0o077:
            raise TierguardError(
                f"{what} {str(path)!r} can be read by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"run `chmod 600 {path}`"
            )
        try:
            return f.read()
        except OSError as exc:
            raise TierguardError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None


def _decode_key(raw: bytes, where: str) -> bytes:
    if len(raw) == KEY_BYTES:
        return raw
    text = raw.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return binascii.unhexlify(text)
        except binascii.Error:
            pass
    try:
        decoded = base64.b64decode(text, validate=True)
    except binascii.Error:
        decoded = b""
    if len(decoded) == KEY_BYTES:
        return decoded
    raise TierguardError(
        f"key file {where!r} must hold {KEY_BYTES} bytes (raw, 64 hex characters or base64), "
        f"got {len(raw)} bytes; make one with `openssl rand -hex 32`"
    )


def is_sealed(blob: bytes | memoryview) -> bool:
    return bytes(blob[: len(MAGIC)]) == MAGIC


def sealed_key_id(blob: bytes | memoryview) -> bytes | None:
    """The key id in a sealed blob's header, or None for anything else. `blob` may be a
    memoryview (a KV block read into a buffer): only the 8 id bytes are copied."""
    if not (is_sealed(blob) and len(blob) >= HEADER_BYTES):
        return None
    return bytes(blob[len(MAGIC) : len(MAGIC) + KEY_ID_BYTES])


class KeyRing:
    """The current key (seals and opens) and old keys (open only, during a rotation).

    Invariant: `open` returns plaintext only after GCM authenticated it with `aad`;
    everything else raises DecryptError.
    """

    def __init__(self, current: Key, old: Iterable[Key] = ()) -> None:
        self.current = current
        self._by_id: dict[bytes, AESGCM] = {}
        for k in (*old, current):  # current last: it wins a (vanishingly unlikely) id clash
            self._by_id[k.id] = AESGCM(k.secret)
        self._sealer = self._by_id[current.id]

    @classmethod
    def from_files(cls, key_file: str | Path, old_key_files: Iterable[str | Path] = ()) -> KeyRing:
        return cls(Key.from_file(key_file), [Key.from_file(p) for p in old_key_files])

    @property
    def key_ids(self) -> list[str]:
        return [k.hex() for k in self._by_id]

    def seal(self, plaintext: bytes | memoryview, aad: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return MAGIC + self.current.id + nonce + self._sealer.encrypt(nonce, plaintext, aad)

    def open(self, blob: bytes | memoryview, aad: bytes) -> bytes:
        aead, nonce = self._opener(blob)
        try:
            return aead.decrypt(nonce, blob[HEADER_BYTES:], aad)
        except InvalidTag:
            raise DecryptError("authentication failed (damaged, or stored under another name)") from None

    def seal_into(self, plaintext: bytes | memoryview, aad: bytes, out: memoryview) -> None:
        """`seal` written into `out` (exactly len(plaintext) + OVERHEAD_BYTES): no copy of the
        ciphertext, for KV blocks of megabytes."""
        nonce = os.urandom(NONCE_BYTES)
        out[:HEADER_BYTES] = MAGIC + self.current.id + nonce
        encrypt_into = getattr(self._sealer, "encrypt_into", None)  # newer cryptography releases (older: a copy)
        if encrypt_into is None:
            out[HEADER_BYTES:] = self._sealer.encrypt(nonce, plaintext, aad)
        else:
            encrypt_into(nonce, plaintext, aad, out[HEADER_BYTES:])

    def open_into(self, blob: bytes | memoryview, aad: bytes, out: memoryview) -> None:
        """`open` written into `out` (exactly the plaintext length). On DecryptError `out`
        is zeroed: no unauthenticated byte is left in it."""
        aead, nonce = self._opener(blob)
        if len(blob) - OVERHEAD_BYTES != len(out):
            raise DecryptError(f"holds {len(blob) - OVERHEAD_BYTES} bytes, expected {len(out)}")
        try:
            decrypt_into = getattr(aead, "decrypt_into", None)  # newer cryptography releases (older: a copy)
            if decrypt_into is None:
                out[:] = aead.decrypt(nonce, blob[HEADER_BYTES:], aad)
            else:
                decrypt_into(nonce, blob[HEADER_BYTES:], aad, out)
        except InvalidTag:
            out[:] = bytes(len(out))
            raise DecryptError("authentication failed (damaged, or stored under another name)") from None

    def _opener(self, blob: bytes | memoryview) -> tuple[AESGCM, bytes]:
        kid = sealed_key_id(blob)
        if kid is None:
            raise DecryptError("not a tierguard envelope (no TGE1 header)")
        aead = self._by_id.get(kid)
        if aead is None:
            raise DecryptError(f"sealed with key {kid.hex()}, which is not configured")
        if len(blob) < OVERHEAD_BYTES:
            raise DecryptError("truncated")
        return aead, bytes(blob[len(MAGIC) + KEY_ID_BYTES : HEADER_BYTES])

    def needs_reseal(self, blob: bytes) -> bool:
        """True when `blob` was sealed with an old key: rewrite it to finish a rotation."""
        return sealed_key_id(blob) != self.current.id
