"""Small specs every tier agrees on: the KV layout, the device pool, and the one fingerprint.

A block's payload is the same bytes on every medium: the block's slice of each device
pool tensor (the KV data, plus its scales when the pool is quantized), laid end to end
with each part aligned to 16 bytes. The tiers move those bytes and never interpret them,
so "the tiers move the quantized bytes" holds by construction.

Blocks-first: every pool tensor has the block index as its outermost dimension, so one
block is one contiguous slice (`t[block_id]`) and a run of blocks is one contiguous range.
Copies and checksums work on whole blocks; a request's blocks move in one gather/scatter.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tierguard.common.errors import TierguardError
from tierguard.kv.media.block_format import is_fingerprint  # noqa: F401 - re-exported: the fingerprint's shape

# A payload part starts on this boundary so a uint8 view can be reinterpreted as any dtype.
PART_ALIGN = 16

QUANT_MODES = ("none", "fp8", "int8")

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise TierguardError(f"unknown KV dtype {name!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise TierguardError(f"unsupported KV dtype {dtype}")


def _align(n: int) -> int:
    return (n + PART_ALIGN - 1) // PART_ALIGN * PART_ALIGN


@dataclass(frozen=True)
class KVLayout:
    """Shape of one device KV pool: [num_blocks, layers, 2, block_size, kv_heads, head_dim].

    `dtype` is the element type of the pool as stored (float8_e4m3fn or int8 when
    quantized); `quantization` says how scales are kept ("none": no scale tensor;
    "fp8"/"int8": a float32 scale per token per KV head, shape
    [num_blocks, layers, 2, block_size, kv_heads]).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float16"
    quantization: str = "none"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if int(getattr(self, name)) <= 0:
                raise TierguardError(f"KV layout {name} must be positive, got {getattr(self, name)}")
        dtype_from_name(self.dtype)
        if self.quantization not in QUANT_MODES:
            raise TierguardError(f"unknown KV quantization {self.quantization!r}; expected {QUANT_MODES}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def scale_shape(self, num_blocks: int) -> tuple[int, ...] | None:
        if self.quantization == "none":
            return None
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads)

    @property
    def data_bytes_per_block(self) -> int:
        itemsize = torch.empty(0, dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def scale_bytes_per_block(self) -> int:
        if self.quantization == "none":
            return 0
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * 4

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block on the host and disk tiers (parts 16-byte aligned)."""
        return _align(self.data_bytes_per_block) + _align(self.scale_bytes_per_block)

    def bytes_per_token(self) -> float:
        return (self.data_bytes_per_block + self.scale_bytes_per_block) / self.block_size


def fingerprint(
    model_id: str, layout: KVLayout, model_config: dict[str, Any] | None = None, weights_digest: str = ""
) -> str:
    """16 hex chars naming everything that makes two blocks with one hash incompatible.

    The one model fingerprint: it roots every request's chain of block hashes
    (`fingerprint_salt`) and names the cold tiers' directories and block headers. Covers
    the model identity (`model_id`: for serve, the SHA-256 of the weights' content with
    the compute dtype and the weight quantization, tierguard/engine/factory.py; for vLLM,
    the same digest of the checkpoint it loads), its config, `weights_digest` when given
    apart, and the KV layout (KV dtype, quantization, block size, shape). A fine-tune in
    the same directory, another dtype or another quantization never reads another's
    blocks. Format 3: block hashes are SHA-256 (tierguard/engine/prefix_hash.py).
    """
    doc = {
        "model": model_id,
        "config": model_config or {},
        "weights": weights_digest,
        "layout": asdict(layout),
        "format": 3,
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint_salt(fp: str) -> int:
    """The root of every block-hash chain of this fingerprint (256 bits, as a block hash);
    `tierguard.engine.prefix_hash.root_hash` mixes a request's `cache_salt` into it."""
    return int.from_bytes(hashlib.sha256(b"tierguard kv fingerprint\x00" + fp.encode("ascii")).digest(), "little")


@dataclass
class DevicePool:
    """The device tensors a block spans; every tensor has the block index outermost.

    `tensors[0]` is the KV data; a quantized pool adds its scale tensor. A block's
    payload is the concatenation of `t[block_id]` over these tensors (each part aligned
    to PART_ALIGN bytes), which is also how the host slab stores it.
    """

    tensors: list[torch.Tensor]

    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> DevicePool:
        tensors = [torch.zeros(layout.pool_shape(num_blocks), dtype=layout.torch_dtype, device=device)]
        scale_shape = layout.scale_shape(num_blocks)
        if scale_shape is not None:
            tensors.append(torch.ones(scale_shape, dtype=torch.float32, device=device))
        return cls(tensors)

    @property
    def num_blocks(self) -> int:
        return int(self.tensors[0].shape[0])

    @property
    def is_cuda(self) -> bool:
        return self.tensors[0].is_cuda

    def part_offsets(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of each tensor's block slice inside a payload."""
        out, offset = [], 0
        for t in self.tensors:
            nbytes = t[0].numel() * t.element_size()
            out.append((offset, nbytes))
            offset += _align(nbytes)
        return out

    @property
    def block_bytes(self) -> int:
        offset, nbytes = self.part_offsets()[-1]
        return offset + _align(nbytes)

    def block_rows(self) -> list[torch.Tensor]:
        """Each tensor as uint8 rows [num_blocks, part bytes]: one row is one whole block."""
        return [t.view(torch.uint8).view(t.shape[0], -1) for t in self.tensors]

    def payload_views(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Typed views into a uint8 payload buffer, one per pool tensor, block-shaped."""
        views = []
        for t, (offset, nbytes) in zip(self.tensors, self.part_offsets(), strict=True):
            views.append(payload[offset : offset + nbytes].view(t.dtype).view(t.shape[1:]))
        return views

    def copy_blocks(
        self,
        block_ids: list[int],
        slab: torch.Tensor,
        slots: list[int],
        to_device: bool,
        non_blocking: bool = False,
    ) -> None:
        """Copy blocks between the pool and rows of a uint8 CPU slab [rows, >= block_bytes]:
        `block_ids[i]` <-> `slab[slots[i]]`, into the pool when `to_device`.

        Every block is a contiguous row on both sides, so a run of adjacent ids landing in
        adjacent slots is one memcpy, and a lone block is one memcpy too (never a strided
        copy). Across devices (CUDA) each pool tensor crosses in one transfer per call: the
        rows are gathered on the device side with one index_select (or packed into pinned
        staging on the host side) and scattered on the other.

        Within host memory the copy is a plain memcpy on the calling thread (numpy, which
        releases the GIL), never a torch op: torch would run it as an OpenMP region, and
        the first OpenMP region on a transfer thread leaves a second thread team alive
        for the life of that thread. With more OpenMP threads than cores, libgomp stops
        spinning at barriers and sleeps instead, which slows every engine step that
        follows, whether or not a tier is ever read again.
        """
        if len(block_ids) != len(slots):
            raise ValueError("copy_blocks needs one slot per block")
        if not block_ids:
            return
        runs = _runs(block_ids, slots)
        cross = self.tensors[0].device != slab.device
        for part, (offset, nbytes) in zip(self.block_rows(), self.part_offsets(), strict=True):
            cols = slab[:, offset : offset + nbytes]
            if not cross:
                pool_rows, slab_rows = part.numpy(), cols.numpy()
                for b, s, n in runs:
                    if to_device:
                        np.copyto(pool_rows[b : b + n], slab_rows[s : s + n])
                    else:
                        np.copyto(slab_rows[s : s + n], pool_rows[b : b + n])
                continue
            staged = torch.empty((len(block_ids), nbytes), dtype=torch.uint8, pin_memory=True)
            ids = torch.tensor(block_ids, dtype=torch.long).to(part.device, non_blocking=True)
            if to_device:
                _pack(staged, cols, runs, into_staging=True)
                part.index_copy_(0, ids, staged.to(part.device, non_blocking=non_blocking))
            else:
                staged.copy_(part.index_select(0, ids))  # blocking: the rows are scattered next
                _pack(staged, cols, runs, into_staging=False)


def _runs(block_ids: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """(first block, first slot, length) of maximal runs where both ids and slots step by 1."""
    runs: list[tuple[int, int, int]] = []
    for b, s in zip(block_ids, slots, strict=True):
        if runs and b == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((b, s, 1))
    return runs


def _pack(
    staged: torch.Tensor, cols: torch.Tensor, runs: list[tuple[int, int, int]], into_staging: bool
) -> None:
    """Move rows between a staging buffer (in block_ids order) and the slab, run by run."""
    row = 0
    for _b, s, n in runs:
        if into_staging:
            staged[row : row + n].copy_(cols[s : s + n])
        else:
            cols[s : s + n].copy_(staged[row : row + n])
        row += n
