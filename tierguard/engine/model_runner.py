"""Turns a schedule into tensors and runs the model over the paged KV cache.

Owns the one device tensor `kv_cache` ([layers, 2, blocks, block_size, kv_heads,
head_dim]; see tierguard/model/attention.py). Knows nothing about scheduling policy.
"""

from __future__ import annotations

import torch

from tierguard.engine.scheduler import ScheduledSeq
from tierguard.model.attention import AttentionMetadata, PrefillChunk
from tierguard.model.config import ModelConfig
from tierguard.model.llama import LlamaModel


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers: 2 x layers x block_size x kv_heads x head_dim x itemsize."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        # Zeroed, not empty: padded decode gathers read real slots that the mask hides,
        # and garbage NaNs there would still poison softmax @ V.
        self.kv_cache = torch.zeros(
            cfg.num_layers,
            2,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=dtype,
            device=device,
        )

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids, positions, attention metadata, and the rows whose logits are sampled.

        Decodes (single-token chunks) must come first in `batch`.
        """
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        decodes = [s for s in batch if s.num_tokens == 1]
        b = len(decodes)
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decodes=b)
        bs = self.block_size
        if b:
            ctx = [s.seq.num_computed_tokens + 1 for s in decodes]
            max_blocks = -(-max(ctx) // bs)
            padded = []
            for i, s in enumerate(decodes):
                table = s.seq.block_table[:max_blocks]
                padded.append(table + [0] * (max_blocks - len(table)))  # block 0: masked padding
                ids.append(s.seq.token_ids[ctx[i] - 1])
                if s.samples:  # a 1-token prefill remainder does not sample
                    sample_rows.append(i)
            tables = torch.tensor(padded, dtype=torch.long)
            ctx_t = torch.tensor(ctx, dtype=torch.long)
            keys = torch.arange(max_blocks * bs)
            meta.decode_blocks = tables.to(self.device)
            meta.decode_mask = (keys.unsqueeze(0) < ctx_t.unsqueeze(1)).view(b, 1, 1, -1).to(self.device)
            last = ctx_t - 1
            positions.append(last)
            slots.append(tables.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs)
        row = b
        for s in batch[b:]:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_tokens
            ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            slots.append(self._slots(seq.block_table, start, end))
            num_ctx_blocks = -(-end // bs)
            chunk = PrefillChunk(row, row + s.num_tokens, start)
            if start:
                chunk.context_blocks = torch.tensor(
                    seq.block_table[:num_ctx_blocks], dtype=torch.long, device=self.device
                )
                q_pos = torch.arange(start, end, device=self.device).unsqueeze(1)
                chunk.mask = torch.arange(end, device=self.device).unsqueeze(0) <= q_pos
            meta.prefills.append(chunk)
            row += s.num_tokens
            if s.samples:
                sample_rows.append(row - 1)
        meta.slot_mapping = torch.cat(slots).to(self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.cat(positions).to(self.device)
        return input_ids, pos_t, meta, sample_rows

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Runs one step; returns float32 logits [num sampled rows, vocab] in sample order."""
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if not sample_rows:
            return torch.empty(0, self.cfg.vocab_size)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()
