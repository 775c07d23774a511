"""Small specs every tier agrees on: mediums, the KV layout and its fingerprint.

A block's payload is the same bytes on every medium: the block's slice of each device
pool tensor (the KV data, plus its scales when the pool is quantized), laid end to end
with each part aligned to 16 bytes. The tiers move those bytes and never interpret them,
so "the tiers move the quantized bytes" holds by construction.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from tierguard.common.errors import TierguardError

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


class Medium(enum.Enum):
    """Where a block's bytes live."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


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
    """Shape of one device KV pool: [layers, 2, num_blocks, block_size, kv_heads, head_dim].

    `dtype` is the element type of the pool as stored (float8_e4m3fn or int8 when
    quantized); `quantization` says how scales are kept ("none": no scale tensor;
    "fp8"/"int8": a float32 scale per token per KV head, shape
    [layers, 2, num_blocks, block_size, kv_heads]).
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
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def scale_shape(self, num_blocks: int) -> tuple[int, ...] | None:
        if self.quantization == "none":
            return None
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads)

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


def fingerprint(model_id: str, layout: KVLayout, weights_digest: str = "") -> str:
    """16 hex chars naming everything that makes two blocks with one hash incompatible.

    Covers the model identity (name and, when known, a digest of its weights), the KV
    dtype, quantization, block size and the full layout, so a different model or layout
    never reads another's blocks even when the token hashes collide.
    """
    doc = {"model": model_id, "weights": weights_digest, "layout": asdict(layout), "format": 1}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_fingerprint(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


@dataclass
class DevicePool:
    """The device tensors a block spans; every tensor has the block index at dim 2.

    `tensors[0]` is the KV data; a quantized pool adds its scale tensor. A block's
    payload is the concatenation of `t[:, :, block_id]` over these tensors.
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
        return int(self.tensors[0].shape[2])

    def part_offsets(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of each tensor's block slice inside a payload."""
        out, offset = [], 0
        for t in self.tensors:
            nbytes = t[:, :, 0].numel() * t.element_size()
            out.append((offset, nbytes))
            offset += _align(nbytes)
        return out

    @property
    def block_bytes(self) -> int:
        offset, nbytes = self.part_offsets()[-1]
        return offset + _align(nbytes)

    def payload_views(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Typed views into a uint8 payload buffer, one per pool tensor, block-shaped."""
        views = []
        for t, (offset, nbytes) in zip(self.tensors, self.part_offsets(), strict=True):
            shape = t[:, :, 0].shape
            views.append(payload[offset : offset + nbytes].view(t.dtype).view(shape))
        return views

    def copy_block(self, block_id: int, payload: torch.Tensor, to_device: bool, non_blocking: bool = False) -> None:
        """Copy one block between the pool and a uint8 payload buffer (laid out as in
        `payload_views`): into the pool when `to_device`, out of it otherwise."""
        for t, view in zip(self.tensors, self.payload_views(payload), strict=True):
            if to_device:
                t[:, :, block_id].copy_(view, non_blocking=non_blocking)
            else:
                view.copy_(t[:, :, block_id], non_blocking=non_blocking)
