"""Attention over a paged KV cache.

KV layout (shared with the host/NVMe tiers; do not change without them):

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = K, V)

so one block across all layers is `kv_cache[:, :, block_id]`. A token's "slot" is
`block_id * block_size + offset`; viewing one layer's K as [num_blocks * block_size,
kv_heads, head_dim] turns block tables into plain gathers.

A forward pass covers a flat batch of tokens, ordered: all decode tokens first (one per
sequence), then each prefill chunk. Decodes are batched into one SDPA call with a padding
mask; each prefill chunk gets its own call (causal inside the chunk, full over the cached
prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
    slot_mapping: torch.Tensor  # [T] slot to write each token's K/V
    num_decodes: int = 0
    decode_blocks: torch.Tensor | None = None  # [B, max_blocks] block tables, padded with block 0
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] True where a key is real
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; kv_layer: [2, N, bs, KV, D]. Returns [T, H * D].

    Writes this step's K/V into the cache first, so decodes read their own token back.
    """
    t, h, d = q.shape
    kvh = k.shape[1]
    group = h // kvh
    k_blocks, v_blocks = kv_layer[0], kv_layer[1]  # [N, bs, KV, D]
    k_flat = k_blocks.view(-1, kvh, d)
    v_flat = v_blocks.view(-1, kvh, d)
    # index_copy_/index_select with 1-D indices: advanced indexing with a 2-D index costs
    # time proportional to the whole cache on CPU. Reads gather whole blocks (fewer,
    # larger copies than per-slot gathers).
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty(t, h * d, dtype=q.dtype, device=q.device)

    b = meta.num_decodes
    if b:
        # Fold the GQA group into the query-length axis: [B, KV, G, D] against [B, KV, L, D].
        qd = q[:b].view(b, kvh, group, d)
        flat = meta.decode_blocks.view(-1)
        kd = k_blocks.index_select(0, flat).view(b, -1, kvh, d).transpose(1, 2)
        vd = v_blocks.index_select(0, flat).view(b, -1, kvh, d).transpose(1, 2)
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
            kp = (
                k_blocks.index_select(0, chunk.context_blocks)
                .view(-1, kvh, d)[:ctx]
                .transpose(0, 1)
                .unsqueeze(0)
            )
            vp = (
                v_blocks.index_select(0, chunk.context_blocks)
                .view(-1, kvh, d)[:ctx]
                .transpose(0, 1)
                .unsqueeze(0)
            )
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, enable_gqa=group > 1)
        out[chunk.start : chunk.end] = op.squeeze(0).transpose(0, 1).reshape(n, h * d)
    return out
