"""Turns a schedule into tensors and runs the model over the paged KV cache.

Owns the device KV pool (`device_pool`, a tierguard.kv.spec.DevicePool): the KV tensor
`kv_cache` ([blocks, layers, 2, block_size, kv_heads, head_dim], blocks first; see
tierguard/model/attention.py) and, when `kv_dtype` is fp8 or int8, the parallel scale
tensor `kv_scale` ([blocks, layers, 2, block_size, kv_heads], float32). Both are indexed
by the same block id, so the tiers move a block's quantized bytes and its scales
together. Knows nothing about scheduling policy.
"""

from __future__ import annotations

import torch

from tierguard.common.errors import TierguardError
from tierguard.engine.scheduler import ScheduledSeq
from tierguard.kv.spec import DevicePool, KVLayout, dtype_name
from tierguard.model.attention import AttentionMetadata, PrefillChunk
from tierguard.model.config import ModelConfig
from tierguard.model.llama import LlamaModel

KV_DTYPES = ("auto", "fp8", "int8")  # auto = the model dtype, no scales


def kv_layout(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str = "auto") -> KVLayout:
    """The device pool's layout for a model dtype and a `--kv-dtype` choice."""
    if kv_dtype == "auto":
        return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype_name(dtype))
    if kv_dtype == "fp8":
        return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, "float8_e4m3fn", "fp8")
    if kv_dtype == "int8":
        return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, "int8", "int8")
    raise TierguardError(f"unknown --kv-dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    """Device bytes of one block across all layers, scales included:
    2 x layers x block_size x kv_heads x (head_dim x itemsize + 4 if quantized)."""
    layout = kv_layout(cfg, block_size, dtype, kv_dtype)
    return layout.data_bytes_per_block + layout.scale_bytes_per_block


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.kv_layout = kv_layout(cfg, block_size, dtype, kv_dtype)
        # Zeroed data and unit scales, not empty: padded decode gathers read real slots
        # that the mask hides, and garbage NaNs there would still poison softmax @ V.
        self.device_pool = DevicePool.allocate(self.kv_layout, num_blocks, device)
        self.kv_cache = self.device_pool.tensors[0]
        self.kv_scale: torch.Tensor | None = (
            self.device_pool.tensors[1] if len(self.device_pool.tensors) > 1 else None
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
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.kv_scale)
        if not sample_rows:
            return torch.empty(0, self.cfg.vocab_size)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()

    def extra_stats(self) -> dict[str, float]:
        """Gauges for EngineStats.extra: KV bytes per token (scales included) and, when
        weights are offloaded, the offload's size and its per-step copy cost."""
        layout = self.kv_layout
        out = {
            "kv_bytes_per_token": float(layout.bytes_per_token()),
            "kv_quantized": float(layout.quantization != "none"),
        }
        offloader = self.model.weight_offloader
        if offloader is not None:
            out.update(offloader.stats().as_gauges())
        return out
