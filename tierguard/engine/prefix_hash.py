"""Content hashes of KV blocks, for prefix caching and the host/NVMe tiers.

A block's hash chains its parent's hash with its own token ids, so equal hashes mean an
equal whole prefix. The first block is chained to the model's fingerprint
(`tierguard.kv.spec.fingerprint`, as `fingerprint_salt`): KV computed by another model,
dtype, KV quantization or block size never matches. Only FULL blocks are hashed; a
partial block's contents are still changing. The tiers key blocks by these same hashes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """hash(parent, tokens): `parent` is the previous block's hash, or the fingerprint."""
    h = xxhash.xxh3_64()
    h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


def prefix_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: int,
    start: int = 0,
    parent: int | None = None,
    limit: int | None = None,
) -> list[int]:
    """Hashes of the full blocks `start, start+1, ...` of `token_ids` (at most `limit`).

    `parent` must be the hash of block `start - 1` when start > 0.
    """
    num_full = len(token_ids) // block_size
    if limit is not None:
        num_full = min(num_full, start + limit)
    prev = fingerprint if start == 0 else parent
    if prev is None:
        raise ValueError("prefix_block_hashes: parent hash is required when start > 0")
    out = []
    for i in range(start, num_full):
        prev = block_hash(prev, token_ids[i * block_size : (i + 1) * block_size])
        out.append(prev)
    return out
