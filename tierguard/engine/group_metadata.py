"""Attention metadata for a pool split into layer groups (tierguard/kv/groups.py).

One `AttentionMetadata` per group, built from that group's block tables: where this
step's K/V go (slot mapping), and what each decode and prefill chunk reads. A full
group reads the whole context, like a single-group pool. A sliding group of window W
reads only the blocks its window reaches and masks the keys outside it: a query at
position p sees keys max(0, p - W + 1) ..= p. The group's blocks before the window may
already be freed (NULL in the sequence's table, stale in the runner's tensor), so they
are never gathered.

All decodes (one token each) come first in the batch, then the prefill chunks, as in
ModelRunner.prepare; the model picks each layer's group metadata (`meta.groups`).
Masks are additive (0 where a key is seen, -inf elsewhere) in the compute dtype: torch's
CPU SDPA takes a boolean mask through a path hundreds of times slower on decode-sized
inputs (a 4-head, 256-wide decode over 32 keys: ~20 ms against ~0.03 ms).
"""

from __future__ import annotations

import torch

from tierguard.kv.groups import KVGroups
from tierguard.model.attention import AttentionMetadata, PrefillChunk


def group_metadata(
    groups: KVGroups,
    tables: torch.Tensor,
    rows: list[int],
    spans: list[tuple[int, int]],
    num_decodes: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> list[AttentionMetadata]:
    """`tables`: [groups, rows, width] block ids; `rows[i]`: sequence i's row; `spans[i]`:
    the positions [start, end) it computes this step (decodes first, one token each)."""
    return [
        _one_group(grp.window, tables[g], rows, spans, num_decodes, block_size, device, dtype)
        for g, grp in enumerate(groups.groups)
    ]


def _one_group(
    window: int | None,
    table: torch.Tensor,
    rows: list[int],
    spans: list[tuple[int, int]],
    b: int,
    bs: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionMetadata:
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=b)
    slots: list[torch.Tensor] = []
    if b:
        rows_t = torch.tensor(rows[:b], dtype=torch.long, device=device)
        ctx = torch.tensor([end for _, end in spans[:b]], dtype=torch.long, device=device)
        first = torch.zeros_like(ctx) if window is None else (ctx - window).clamp(min=0) // bs
        width = int((-(-ctx // bs) - first).max())
        idx = (first.unsqueeze(1) + torch.arange(width, device=device)).clamp(max=table.shape[1] - 1)
        blocks = table.index_select(0, rows_t).gather(1, idx).long()
        keys = (first * bs).unsqueeze(1) + torch.arange(width * bs, device=device)
        visible = keys < ctx.unsqueeze(1)
        if window is not None:
            visible &= keys >= (ctx - window).unsqueeze(1)
        meta.decode_blocks = blocks
        meta.decode_mask = _additive(visible, dtype).view(b, 1, 1, -1)
        last = ctx - 1
        slots.append(table[rows_t, last // bs].long() * bs + last % bs)
    row = b
    for (start, end), table_row in zip(spans[b:], rows[b:], strict=True):
        n = end - start
        p = torch.arange(start, end, device=device)
        slots.append(table[table_row, p // bs].long() * bs + p % bs)
        chunk = PrefillChunk(row, row + n, start)
        first_key = 0 if window is None else max(0, start - window + 1) // bs * bs
        if start:
            chunk.context_blocks = table[table_row, first_key // bs : -(-end // bs)].long()
            chunk.first_key = first_key
            keys = torch.arange(first_key, end, device=device).unsqueeze(0)
            chunk.mask = _additive(_visible(keys, p.unsqueeze(1), window), dtype)
        elif window is not None and n > window:
            keys = torch.arange(end, device=device).unsqueeze(0)
            chunk.mask = _additive(_visible(keys, p.unsqueeze(1), window), dtype)
        meta.prefills.append(chunk)
        row += n
    if slots:
        meta.slot_mapping = torch.cat(slots)
    return meta


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `visible`, -inf elsewhere (every query sees at least itself)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _visible(keys: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys]: causal, and within the window when there is one."""
    mask = keys <= queries
    if window is not None:
        mask &= keys > queries - window
    return mask
