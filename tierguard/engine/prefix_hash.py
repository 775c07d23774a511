"""Content hashes of KV blocks, for prefix caching and every KV tier.

A block's hash is SHA-256 over its parent's hash and its own token ids, so equal hashes
mean an equal whole prefix: the chain is a cryptographic digest of every token before
the block's end. The first block's parent is the request's root (`root_hash`): the
model's fingerprint (`tierguard.kv.spec.fingerprint`, as `fingerprint_salt`), mixed
with the request's `cache_salt` when it has one. KV computed by another model, dtype,
KV quantization, block size, or for another tenant's salt never matches. Only FULL
blocks are hashed; a partial block's contents are still changing. The device prefix
cache, host RAM, disk and Redis all key blocks by these same hashes, and the disk and
Redis tiers store the full hash in each block's header and serve a block only when it
equals the reader's (tierguard/kv/media/block_format.py): the stored block was made
from the reader's token ids.

Why SHA-256: a 64-bit hash lets anyone who can choose prompts find two prefixes with
one name in about 2**32 tries, and a cold tier shared through Redis trusts names. With
SHA-256 (what vLLM's prefix cache uses for the same reason) a collision costs about
2**128 hashes. It is unkeyed on purpose: replicas that share a tier must agree on the
names without sharing a secret; the root already separates models and tenants. Hashes
are Python ints of 256 bits. A run of blocks converts its token ids once, so a block
costs one SHA-256 of a few hundred bytes and no per-block array conversion.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

HASH_BYTES = 32  # SHA-256: a block hash is an int in [0, 2**256)
_ROOT_TAG = b"tierguard kv root\x00"


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """hash(parent, tokens): `parent` is the previous block's hash, or the request's root."""
    data = parent.to_bytes(HASH_BYTES, "little") + np.asarray(token_ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest(), "little")


def root_hash(fingerprint_root: int, cache_salt: str | None = None) -> int:
    """The parent of a request's first block: the model's root, mixed with the request's
    `cache_salt` when it has one (requests with different salts share no block)."""
    if not cache_salt:
        return fingerprint_root
    data = _ROOT_TAG + fingerprint_root.to_bytes(HASH_BYTES, "little") + cache_salt.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(data).digest(), "little")


def prefix_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: int,
    start: int = 0,
    parent: int | None = None,
    limit: int | None = None,
) -> list[int]:
    """Hashes of the full blocks `start, start+1, ...` of `token_ids` (at most `limit`).

    `fingerprint` is the root of block 0 (`root_hash`); `parent` must be the hash of
    block `start - 1` when start > 0.
    """
    num_full = len(token_ids) // block_size
    if limit is not None:
        num_full = min(num_full, start + limit)
    prev = fingerprint if start == 0 else parent
    if prev is None:
        raise ValueError("prefix_block_hashes: parent hash is required when start > 0")
    if num_full <= start:
        return []
    # One conversion for the whole run: per-block conversions cost more than the hashing.
    raw = np.asarray(token_ids[start * block_size : num_full * block_size], dtype=np.int64).tobytes()
    step = block_size * 8
    sha, out = hashlib.sha256, []
    for off in range(0, len(raw), step):
        prev = int.from_bytes(sha(prev.to_bytes(HASH_BYTES, "little") + raw[off : off + step]).digest(), "little")
        out.append(prev)
    return out
