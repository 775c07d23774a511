"""Cold KV at rest: the AES-256-GCM `BlockCodec` behind `--kv-encrypt-key-file`.

KV blocks are derived from user prompts and can be inverted to text, so a block that
leaves the process (a disk file, a remote store) is sealed. This codec is the glue
between the medium-neutral block format (block_format.py) and the envelope the gate's
job files already use (tierguard/common/crypto.py, one implementation for both):

- `encode` seals the payload with the current key; the block's fingerprint and hash are
  the associated data, so a file copied under another block's name or into another
  model's directory fails authentication instead of decrypting as the wrong KV;
- the header carries codec id 1 and the first 4 bytes of the key id (the envelope itself
  carries all 8), so a reader tells "sealed with a key I hold" (current or old, during a
  rotation) from "another key's block" without decrypting anything;
- `decode` returns False for any failure (unknown key, damage, wrong place): the medium
  counts an undecodable miss and the prefix is recomputed; nothing else sees plaintext.

Stored bytes: the envelope, `"TGE1" | key id (8) | nonce (12) | ciphertext | tag (16)`,
40 bytes more than the payload. A random 96-bit nonce per block; rotate keys long before
2^32 blocks were written with one.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tierguard.common.crypto import OVERHEAD_BYTES, DecryptError, Key, KeyRing

AES_GCM_CODEC = 1


def header_key_id(key: Key | bytes) -> int:
    """The u32 a block header stores for a key: the first 4 bytes of its 8-byte id."""
    kid = key.id if isinstance(key, Key) else key
    return int.from_bytes(kid[:4], "little")


class AesGcmCodec:
    """Seals blocks with the current key; opens blocks sealed with the current or an old one."""

    codec_id = AES_GCM_CODEC

    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring
        self.key_id = header_key_id(ring.current)
        # Header ids of every key held (current included), for decisions without decrypting.
        self.key_ids = frozenset(header_key_id(bytes.fromhex(k)) for k in ring.key_ids)

    @classmethod
    def from_files(cls, key_file: str | Path, old_key_files: Iterable[str | Path] = ()) -> AesGcmCodec:
        """Read the key files (TierguardError for a missing, loose or malformed one)."""
        return cls(KeyRing.from_files(key_file, list(old_key_files)))

    def __repr__(self) -> str:  # names the keys by id only, never the secret
        return f"AesGcmCodec(key={self.ring.current.id_hex}, keys={len(self.key_ids)})"

    def stored_len(self, payload_len: int) -> int:
        return payload_len + OVERHEAD_BYTES

    def encode(self, payload: memoryview, aad: bytes) -> memoryview:
        out = memoryview(bytearray(self.stored_len(payload.nbytes)))
        self.ring.seal_into(payload, aad, out)
        return out

    def decode(self, stored: memoryview, aad: bytes, out: memoryview, key_id: int) -> bool:
        if key_id not in self.key_ids:
            return False  # another key's block: not even an attempt
        try:
            self.ring.open_into(stored, aad, out)  # straight into the host slot
        except DecryptError:
            return False
        return True

    def readable(self, codec_id: int, key_id: int) -> bool:
        """Whether a block with this header could be opened here (no I/O, no decryption)."""
        return codec_id == self.codec_id and key_id in self.key_ids

    def is_current(self, key_id: int) -> bool:
        """False for a block sealed with an old key: rewrite it to finish a rotation."""
        return key_id == self.key_id
