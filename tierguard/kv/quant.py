"""KV quantization for the device pool (R7: try it before offloading), and its error.

Modes and layout (pool shapes from `KVLayout`):
- "none": KV kept in the model dtype, no scales.
- "int8": symmetric int8, one float32 scale per (block, layer, K|V, token, kv_head):
  scale = max|x| over head_dim / 127, q = round(x / scale).
- "fp8": float8_e4m3fn with the same per-token-head float32 scale
  (scale = max|x| / 448, the e4m3 maximum). Scales are per token so a block can be
  written token by token (decode) without rescaling what is already stored.
  `granularity="tensor"` instead uses one scale for the whole tensor (vLLM's plain fp8),
  offered for measurement only.

The scale tensor is part of the pool (`DevicePool` includes it), so host and disk tiers
move quantized bytes plus scales; `bytes_per_token` counts both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tierguard.kv.spec import KVLayout

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0
_EPS = 1e-12


def quantize(
    x: torch.Tensor, mode: str, granularity: str = "token_head"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x[..., head_dim]; returns (values, float32 scales of shape x.shape[:-1])."""
    xf = x.float()
    if granularity == "token_head":
        amax = xf.abs().amax(dim=-1)
    elif granularity == "tensor":
        amax = xf.abs().amax().expand(x.shape[:-1])
    else:
        raise ValueError(f"unknown scale granularity {granularity!r}")
    if mode == "int8":
        scale = (amax / INT8_MAX).clamp_min(_EPS)
        q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif mode == "fp8":
        scale = (amax / FP8_MAX).clamp_min(_EPS)
        q = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    elif mode == "fp16":  # the unquantized pool, as a yardstick for the other modes
        scale = torch.ones_like(amax)
        q = xf.half()
    else:
        raise ValueError(f"unknown KV quantization mode {mode!r}")
    return q, scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def write_slots(
    pool_data: torch.Tensor,
    pool_scale: torch.Tensor | None,
    layer: int,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mode: str,
) -> None:
    """Store k, v [tokens, kv_heads, head_dim] at flat slots (block * block_size + offset)."""
    where = _block_offset(pool_data, slots)
    for idx, x in ((0, k), (1, v)):
        pages = pool_data[:, layer, idx]
        if mode == "none":
            pages[where] = x.to(pages.dtype)
            continue
        if pool_scale is None:
            raise ValueError("a quantized pool needs its scale tensor")
        q, s = quantize(x, mode)
        pages[where] = q
        pool_scale[:, layer, idx][where] = s


def read_slots(
    pool_data: torch.Tensor,
    pool_scale: torch.Tensor | None,
    layer: int,
    slots: torch.Tensor,
    mode: str,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather (k, v) [tokens, kv_heads, head_dim] from flat slots, dequantized to `dtype`."""
    where = _block_offset(pool_data, slots)
    out = []
    for idx in (0, 1):
        x = pool_data[:, layer, idx][where]
        if mode == "none":
            out.append(x.to(dtype))
            continue
        if pool_scale is None:
            raise ValueError("a quantized pool needs its scale tensor")
        out.append(dequantize(x, pool_scale[:, layer, idx][where], dtype))
    return out[0], out[1]


def _block_offset(pool_data: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slots as (block, offset) indices into a blocks-first pool."""
    bs = pool_data.shape[3]
    return slots // bs, slots % bs


def bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, mode: str, base_dtype: str = "float16"
) -> int:
    """KV bytes per token including scales (4 bytes per token per KV head for K and for V)."""
    if mode == "none":
        return KVLayout(num_layers, num_kv_heads, head_dim, 1, base_dtype).data_bytes_per_block
    dtype = "int8" if mode == "int8" else "float8_e4m3fn"
    layout = KVLayout(num_layers, num_kv_heads, head_dim, 1, dtype, mode)
    return layout.data_bytes_per_block + layout.scale_bytes_per_block


@dataclass
class AttentionError:
    mode: str
    granularity: str
    context: int
    max_abs: float
    mean_abs: float
    ref_mean_abs: float  # mean |output| of the reference, to read the error against

    @property
    def rel_mean(self) -> float:
        return self.mean_abs / max(self.ref_mean_abs, _EPS)


def random_qkv(
    context: int,
    q_len: int = 16,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    outlier_channels: int = 4,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random Q [heads, q_len, d], K/V [kv_heads, context, d]; K gets a few large channels,
    as real keys do, which is what makes per-token scales matter."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_heads, q_len, head_dim, generator=g)
    k = torch.randn(num_kv_heads, context, head_dim, generator=g)
    v = torch.randn(num_kv_heads, context, head_dim, generator=g)
    if outlier_channels:
        idx = torch.randperm(head_dim, generator=g)[:outlier_channels]
        k[..., idx] *= 8.0
    return q, k, v


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last q_len positions over the whole context, fp32, GQA."""
    heads, q_len, d = q.shape
    group = heads // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    ctx = k.shape[1]
    pos_q = torch.arange(ctx - q_len, ctx).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(ctx).unsqueeze(0) > pos_q, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attention_error(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str, granularity: str = "token_head"
) -> AttentionError:
    """Max/mean |attention(q, K, V) - attention(q, deq(quant(K)), deq(quant(V)))| in fp32."""
    q, k, v = q.float(), k.float(), v.float()
    ref = _attention(q, k, v)
    kq, ks = quantize(k, mode, granularity)
    vq, vs = quantize(v, mode, granularity)
    out = _attention(q, dequantize(kq, ks), dequantize(vq, vs))
    diff = (out - ref).abs()
    return AttentionError(
        mode, granularity, k.shape[1], float(diff.max()), float(diff.mean()), float(ref.abs().mean())
    )


def token_agreement(reference: list[int], candidate: list[int]) -> tuple[float, int | None]:
    """(share of positions equal, first index where they differ or None) over the shorter list."""
    n = min(len(reference), len(candidate))
    if n == 0:
        return 1.0, None
    same = [reference[i] == candidate[i] for i in range(n)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return sum(same) / n, first


def report(
    contexts: tuple[int, ...] = (2048, 8192, 32768),
    num_layers: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
) -> dict:
    """Attention error per mode and context, and KV bytes per token (as for an 8B GQA model)."""
    out: dict = {
        "bytes_per_token": {
            m: bytes_per_token(num_layers, num_kv_heads, head_dim, m) for m in ("none", "int8", "fp8")
        },
        "errors": [],
    }
    for ctx in contexts:
        q, k, v = random_qkv(
            ctx, q_len=16, num_heads=4 * num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
        )
        for mode, gran in (
            ("fp16", "token_head"),
            ("int8", "token_head"),
            ("fp8", "token_head"),
            ("fp8", "tensor"),
        ):
            e = attention_error(q, k, v, mode, gran)
            out["errors"].append(
                {
                    "mode": mode,
                    "scale": gran,
                    "context": ctx,
                    "max_abs": round(e.max_abs, 5),
                    "mean_abs": round(e.mean_abs, 6),
                    "rel_mean": round(e.rel_mean, 4),
                }
            )
    return out


if __name__ == "__main__":
    import json

    result = report()
    print(json.dumps({"bytes_per_token": result["bytes_per_token"]}))
    for row in result["errors"]:
        print(json.dumps(row))
