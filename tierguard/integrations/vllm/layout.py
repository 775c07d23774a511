"""What a stored block is, for vLLM's KV cache: its geometry, its fingerprint, its hashes.

A block's payload is the same bytes the tiers move for our own engine (tierguard/kv/spec.py
`DevicePool`): the block's slice of every per-layer KV tensor, laid end to end in the
order of the KV cache group's layer names, each part aligned to 16 bytes. vLLM's per-layer
caches keep the block index outermost (CPU: [blocks, kv heads, block size, 2 x head size];
GPU layouts whose blocks are outermost likewise), so one block of one layer is one
contiguous slice and `DevicePool.copy_blocks` moves it unchanged.

The fingerprint (`tierguard.kv.spec.fingerprint`) names the model (the SHA-256 of the
checkpoint files vLLM loads, its config, dtype and quantization), the KV dtype, block
size, KV heads, head size, layer count, page bytes and vLLM's cache layout name: blocks
written by another model (a fine-tune in the same directory included), dtype or layout
are never read. Block hashes are the SHA-256 chain of tierguard/engine/prefix_hash.py,
rooted in the fingerprint and the request's `cache_salt`, as our engine's are; vLLM's own
block hashes may be seeded per process, so they cannot name a block across a restart or
between replicas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierguard.common.errors import TierguardError
from tierguard.engine.prefix_hash import prefix_block_hashes, root_hash
from tierguard.kv.spec import PART_ALIGN, DevicePool, KVLayout, dtype_name, fingerprint, fingerprint_salt
from tierguard.kv.weights_digest import WEIGHT_PATTERNS


@dataclass(frozen=True)
class BlockGeometry:
    """One KV cache group as the connector sees it (computed the same way in both roles)."""

    layer_names: tuple[str, ...]  # unique caches, in the group's order
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str  # tierguard.kv.spec dtype name
    page_bytes: int  # one block of one layer
    cache_layout: str = ""  # vLLM's KV cache layout name, when known

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block: every layer's page, each 16-byte aligned."""
        aligned = (self.page_bytes + PART_ALIGN - 1) // PART_ALIGN * PART_ALIGN
        return aligned * len(self.layer_names)

    def layout(self) -> KVLayout:
        return KVLayout(len(self.layer_names), self.num_kv_heads, self.head_size, self.block_size, self.dtype)


def _jsonable(config: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(config), sort_keys=True, default=str))


def vllm_fingerprint(
    weights_digest: str,
    model_config: Mapping[str, Any],
    geometry: BlockGeometry,
    model_dtype: str = "",
    quantization: str = "",
) -> str:
    """16 hex characters naming the model and the exact KV bytes a block holds.

    `weights_digest`: `checkpoint_digest` of the files vLLM loads (the content, not the
    path: replicas loading one checkpoint from different paths share blocks); `model_dtype`
    and `quantization`: vLLM's model dtype and weight quantization method (same weights,
    other numerics: other KV)."""
    doc = {
        "engine": "vllm",
        "hf_config": _jsonable(model_config),
        "page_bytes": geometry.page_bytes,
        "cache_layout": geometry.cache_layout,
        "dtype": model_dtype,
        "quantization": quantization,
    }
    return fingerprint(f"sha256:{weights_digest}", geometry.layout(), doc)


def checkpoint_digest(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The SHA-256 of the weight files vLLM loads for `model` (tierguard/kv/weights_digest.py,
    cached per file): a local directory's weight files, or the snapshot a Hugging Face
    model id resolves to in the local cache (never downloaded here). Raises
    TierguardError when no weight file can be found: a fingerprint that cannot tell a
    fine-tune from its base must not name shared blocks."""
    from tierguard.kv.weights_digest import weight_files, weights_digest

    path = Path(model)
    if path.is_file():
        return weights_digest([path])
    if not path.is_dir():
        path = _hf_snapshot(model, revision, download_dir)
    files = weight_files(path) if path is not None else []
    if not files:
        raise TierguardError(
            f"TierguardConnector: no weight files found for {model!r} (looked for {', '.join(WEIGHT_PATTERNS)}); "
            "the KV fingerprint needs the checkpoint's content"
        )
    return weights_digest(files)


def _hf_snapshot(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True))
    except Exception:  # not in the local cache, or not a hub id
        return None


def geometry_from_spec(
    layer_names: Sequence[str],
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    torch_dtype: torch.dtype,
    page_bytes: int,
    cache_layout: str = "",
    shared: Mapping[str, str] | None = None,
) -> BlockGeometry:
    """`shared`: layers that reuse another layer's cache (they are not stored twice)."""
    try:
        name = dtype_name(torch_dtype)
    except TierguardError:
        raise TierguardError(
            f"TierguardConnector: KV cache dtype {torch_dtype} is not supported (float32, float16, bfloat16)"
        ) from None
    shared = shared or {}
    unique = tuple(n for n in layer_names if n not in shared)
    if not unique:
        raise TierguardError("TierguardConnector: the KV cache group has no layers")
    return BlockGeometry(
        unique, int(block_size), int(num_kv_heads), int(head_size), name, int(page_bytes), cache_layout
    )


def device_pool(kv_caches: Mapping[str, torch.Tensor], geometry: BlockGeometry) -> DevicePool:
    """vLLM's per-layer caches as a DevicePool, checked against the geometry the
    fingerprint names (a mismatch is an error at start-up, never a wrong block later)."""
    tensors = []
    for name in geometry.layer_names:
        if name not in kv_caches:
            raise TierguardError(f"TierguardConnector: vLLM registered no KV cache for layer {name!r}")
        t = kv_caches[name]
        if isinstance(t, list | tuple):
            raise TierguardError(f"TierguardConnector: layer {name!r} has a split K/V cache; not supported")
        if not t.is_contiguous():
            raise TierguardError(f"TierguardConnector: the KV cache of {name!r} is not contiguous")
        page = t[0].numel() * t.element_size()
        if page != geometry.page_bytes:
            raise TierguardError(
                f"TierguardConnector: layer {name!r} holds {page} bytes per block, expected {geometry.page_bytes}"
                f" (shape {tuple(t.shape)}): the block index must be the outermost dimension"
            )
        tensors.append(t)
    pool = DevicePool(tensors)
    if pool.block_bytes != geometry.block_bytes:
        raise TierguardError(
            f"TierguardConnector: block payload {pool.block_bytes} != {geometry.block_bytes} bytes"
        )
    return pool


def request_salt(fp: str, cache_salt: str | None) -> int:
    """The parent of a request's first block hash: the fingerprint's root, mixed with
    vLLM's per-request `cache_salt` when the request has one (salted prefixes never mix),
    exactly as our engine roots its chains (`root_hash`)."""
    return root_hash(fingerprint_salt(fp), cache_salt)


class RequestHashes:
    """Chained hashes of a request's full blocks, extended as its tokens grow (each block
    is hashed once per request)."""

    def __init__(self, parent: int, block_size: int) -> None:
        self.parent = parent
        self.block_size = block_size
        self.hashes: list[int] = []

    def upto(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Hashes of the full blocks among the first `num_tokens` tokens."""
        want = num_tokens // self.block_size
        have = len(self.hashes)
        if want > have:
            prev = self.hashes[-1] if self.hashes else None
            tokens = token_ids[: want * self.block_size]
            if have == 0:
                self.hashes = prefix_block_hashes(tokens, self.block_size, self.parent)
            else:
                self.hashes += prefix_block_hashes(
                    tokens, self.block_size, self.parent, start=have, parent=prev
                )
        return self.hashes[:want]
