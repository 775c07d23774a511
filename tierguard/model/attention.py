"""Attention over a paged KV cache.

KV layout (shared with the host/NVMe tiers, see tierguard/kv/spec.py), blocks first:

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   (2 = K, V)

so one block across all layers is the contiguous slice `kv_cache[block_id]`, and the
tiers copy whole blocks. A layer sees `kv_cache[:, layer]` ([num_blocks, 2, block_size,
kv_heads, head_dim], strided over blocks). A token's "slot" is `block_id * block_size +
offset`; writes go to (slot // block_size, slot % block_size) and reads gather whole
blocks with 1-D indices.

A quantized pool (`--kv-dtype fp8|int8`, see tierguard/kv/quant.py) stores int8 or
float8_e4m3fn values plus a parallel float32 scale tensor indexed by the same block id:

    kv_scale: [num_blocks, num_layers, 2, block_size, num_kv_heads]   (one scale per token-head)

K/V are quantized when written and only the gathered pages are dequantized, to the
compute dtype, right before SDPA. A prefill chunk with nothing cached attends to its own
unquantized K/V (they are in registers anyway); everything read back from the pool went
through quantization.

A forward pass covers a flat batch of tokens, ordered: all decode tokens first (one per
sequence), then each prefill chunk. On the CPU with a float32 pool, decodes go to one
call of the C kernel per layer (tierguard/model/native.py: writes the new K/V and
attends over the blocks where they are, no copy). Otherwise decodes gather their blocks
and are batched into one SDPA call with a padding mask. Each prefill chunk gets its own
SDPA call (causal inside the chunk, full over the cached prefix).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tierguard.kv.quant import dequantize, quantize

# Pool dtype -> tierguard.kv.quant mode name.
QUANT_MODE_OF = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat token batch
    end: int  # one past the last row
    num_cached: int  # tokens already in the cache before this chunk
    # Blocks holding the whole context (cached prefix + this chunk); None when nothing was
    # cached, because then the chunk's own K/V are the whole context.
    context_blocks: torch.Tensor | None = None
    # [n, num_cached + n]: query i (position num_cached + i) sees keys 0 ..= num_cached + i.
    # Built once per step by the runner, shared by all layers; None with context_blocks.
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    # [T] slot to write each token's K/V; with `decode_call`, the prefill rows' only.
    slot_mapping: torch.Tensor
    num_decodes: int = 0
    decode_blocks: torch.Tensor | None = None  # [B, max_blocks] block tables, padded with block 0
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] True where a key is real
    prefills: list[PrefillChunk] = field(default_factory=list)
    # native.DecodeCall when the decodes use the CPU kernel (then decode_blocks/mask are unused).
    decode_call: Any = None
    # A DecodeCall with a row for every token of the step, decodes and prefill chunks alike
    # (a chunk's token i: its sequence's table row, context num_cached + i + 1), for the
    # fused whole-step kernel (tierguard/model/fused_decode.py); the fields above remain
    # for the per-op path, which runs when the fused step steps aside.
    step_call: Any = None


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A same-size integer view: CPU kernels lack index_copy_ for float8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _store(
    kv_layer: torch.Tensor,
    scale_layer: torch.Tensor | None,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    bs = kv_layer.shape[2]
    where = (slots // bs, slots % bs)  # (block, offset): two 1-D indices, cost ~ tokens written
    for idx, x in ((0, k), (1, v)):
        pages = kv_layer[:, idx]
        if scale_layer is None:
            pages.index_put_(where, x)
            continue
        q, scale = quantize(x, QUANT_MODE_OF[kv_layer.dtype])
        _raw(pages).index_put_(where, _raw(q))
        scale_layer[:, idx].index_put_(where, scale)


def _gather(
    kv_layer: torch.Tensor,
    scale_layer: torch.Tensor | None,
    idx: int,
    blocks: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Blocks [n, block_size, KV, D] of K (idx 0) or V (1), dequantized to `dtype`."""
    pages = _raw(kv_layer[:, idx]).index_select(0, blocks)
    if scale_layer is None:
        return pages
    scales = scale_layer[:, idx].index_select(0, blocks)
    if kv_layer.dtype == torch.float8_e4m3fn and pages.device.type == "cpu":
        # CPU float8 -> float32 casts take a slow scalar path; a 256-entry table lookup
        # gives the same values several times faster.
        values = _fp8_table().index_select(0, pages.reshape(-1).int()).view(pages.shape)
        return (values * scales.unsqueeze(-1)).to(dtype)
    return dequantize(pages.view(kv_layer.dtype), scales, dtype)


@functools.cache
def _fp8_table() -> torch.Tensor:
    """float32 value of every e4m3 bit pattern (CPU)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale_layer: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; kv_layer: [N, 2, bs, KV, D]. Returns [T, H * D].

    `scale_layer` ([N, 2, bs, KV]) is given exactly when the pool is quantized.
    Writes this step's K/V into the cache first, so decodes read their own token back.
    """
    t, h, d = q.shape
    kvh = k.shape[1]
    group = h // kvh
    # 1-D indices only: advanced indexing with a 2-D index costs time proportional to the
    # whole cache on CPU. Reads gather whole blocks (fewer, larger copies than per-slot).
    b = meta.num_decodes
    if b and meta.decode_call is not None and scale_layer is None:
        # The kernel writes the decodes' K/V and attends in place.
        out_decodes = meta.decode_call.run(q[:b], k[:b], v[:b], kv_layer)
        if not meta.prefills:
            return out_decodes
        _store(kv_layer, None, meta.slot_mapping, k[b:], v[b:])
        out = torch.empty(t, h * d, dtype=q.dtype, device=q.device)
        out[:b] = out_decodes
        b = 0
    else:
        _store(kv_layer, scale_layer, meta.slot_mapping, k, v)
        out = torch.empty(t, h * d, dtype=q.dtype, device=q.device)
    if b:
        # Fold the GQA group into the query-length axis: [B, KV, G, D] against [B, KV, L, D].
        qd = q[:b].view(b, kvh, group, d)
        flat = meta.decode_blocks.view(-1)
        kd = _gather(kv_layer, scale_layer, 0, flat, q.dtype).view(b, -1, kvh, d).transpose(1, 2)
        vd = _gather(kv_layer, scale_layer, 1, flat, q.dtype).view(b, -1, kvh, d).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
        out[:b] = od.reshape(b, h * d)

    for chunk in meta.prefills:
        n = chunk.end - chunk.start
        qp = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.context_blocks is None:
            kp = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            vp = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=group > 1)
        else:
            ctx = chunk.num_cached + n
            blocks = chunk.context_blocks
            kp = _gather(kv_layer, scale_layer, 0, blocks, q.dtype).view(-1, kvh, d)[:ctx]
            vp = _gather(kv_layer, scale_layer, 1, blocks, q.dtype).view(-1, kvh, d)[:ctx]
            kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, enable_gqa=group > 1)
        out[chunk.start : chunk.end] = op.squeeze(0).transpose(0, 1).reshape(n, h * d)
    return out
