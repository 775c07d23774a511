"""Turns a schedule into tensors and runs the model over the paged KV cache.

Owns the device KV pool (`device_pool`, a tierguard.kv.spec.DevicePool): the KV tensor
`kv_cache` ([blocks, layers, 2, block_size, kv_heads, head_dim], blocks first; see
tierguard/model/attention.py) and, when `kv_dtype` is fp8 or int8, the parallel scale
tensor `kv_scale` ([blocks, layers, 2, block_size, kv_heads], float32). Both are indexed
by the same block id, so the tiers move a block's quantized bytes and its scales
together. Knows nothing about scheduling policy.

A model with sliding-window layers (Gemma 3) splits the pool into layer groups
(tierguard/kv/groups.py): the pool's second dimension is the group width instead of
all layers, every sequence has a table row per group, and each group gets its own
attention metadata (group_metadata.py). Such a model runs on the torch path: the C
decode kernel, the fused step and decode graphs assume one table for every layer.
"""

from __future__ import annotations

import torch

from tierguard.common.errors import TierguardError
from tierguard.engine.decode_graphs import DecodeGraphs
from tierguard.engine.group_metadata import group_metadata
from tierguard.engine.scheduler import ScheduledSeq
from tierguard.kv.groups import KVGroups
from tierguard.kv.spec import DevicePool, KVLayout, dtype_name
from tierguard.model import fused_decode, native
from tierguard.model.attention import AttentionMetadata, PrefillChunk
from tierguard.model.config import ModelConfig
from tierguard.model.gemma3 import kv_groups
from tierguard.model.llama import LlamaModel
from tierguard.model.quantize import weight_bytes

KV_DTYPES = ("auto", "fp8", "int8")  # auto = the model dtype, no scales
WEIGHT_BITS = {"bf16": 16, "int8": 8, "int4": 4}  # nominal; the gauge weight_bytes has the exact size


def kv_layout(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str = "auto") -> KVLayout:
    """The device pool's layout for a model dtype and a `--kv-dtype` choice; a block spans
    one layer group (every layer unless the model has sliding-window layers)."""
    layers = kv_groups(cfg).width
    if kv_dtype == "auto":
        return KVLayout(layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype_name(dtype))
    if kv_dtype == "fp8":
        return KVLayout(layers, cfg.num_kv_heads, cfg.head_dim, block_size, "float8_e4m3fn", "fp8")
    if kv_dtype == "int8":
        return KVLayout(layers, cfg.num_kv_heads, cfg.head_dim, block_size, "int8", "int8")
    raise TierguardError(f"unknown --kv-dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    """Device bytes of one block across its layers (a group's), scales included:
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
        decode_graph_max_batch: int = 0,
        max_blocks_per_seq: int = 128,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.kv_layout = kv_layout(cfg, block_size, dtype, kv_dtype)
        self.groups: KVGroups = kv_groups(cfg)
        hybrid = self.groups.hybrid
        # Zeroed data and unit scales, not empty: padded decode gathers read real slots
        # that the mask hides, and garbage NaNs there would still poison softmax @ V.
        # Decode graphs (decode_graphs.py) pad with a scratch block no sequence owns: one
        # block past those the engine's pool hands out. Not with streamed weights (their
        # host copies happen in hooks a graph would not replay).
        graphs = decode_graph_max_batch > 0 and model.weight_offloader is None and not hybrid
        self.device_pool = DevicePool.allocate(self.kv_layout, num_blocks + int(graphs), device)
        self.kv_cache = self.device_pool.tensors[0]
        self.kv_scale: torch.Tensor | None = (
            self.device_pool.tensors[1] if len(self.device_pool.tensors) > 1 else None
        )
        self._weight_bytes = weight_bytes(model)
        # Decodes on the CPU kernel when it covers this pool (float32, built); else gather + SDPA.
        self.native_decode = (
            not hybrid
            and self.kv_scale is None
            and native.supports(self.kv_cache[:, 0], dtype, cfg.num_heads, cfg.num_kv_heads)
        )
        # Block tables: [group, row per sequence (see _row), block]; grown on demand.
        self._tables = torch.zeros(self.groups.num_groups, 16, 64, dtype=torch.int32)
        self._tables_dev: torch.Tensor | None = None
        self._tables_dirty = True
        self._rows: dict[str, list] = {}  # seq id -> [row, the table list, entries written]
        self._free_rows: list[int] = list(range(15, -1, -1))
        self.decode_graphs: DecodeGraphs | None = None
        if graphs:
            self.decode_graphs = DecodeGraphs(
                self._logits_of_all,
                block_size,
                max_blocks_per_seq,
                scratch_block=num_blocks,
                device=device,
                max_batch=decode_graph_max_batch,
                capture=device.type == "cuda",
            )

    @property
    def compute_path(self) -> str:
        """How steps are computed, for serve's ready line and logs."""
        return getattr(
            self.model, "compute_path", "C decode kernels" if self.native_decode else "torch (SDPA attention)"
        )

    @property
    def weight_dtype(self) -> str:
        """auto (float weights), int8 or int4."""
        return getattr(self.model, "weight_dtype", "auto")

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights, quantized scales included, each storage once."""
        return weight_bytes(self.model)

    # -- block tables: one persistent int32 row per sequence, updated by what changed --------
    def _row(self, seq) -> int:
        """The sequence's row in the table, with entries appended since the last step written.

        Tables only grow by append or are replaced (admission, preemption), so the list's
        identity tells a replaced table apart; holding the list keeps its id unique.
        Cost per step ~ blocks added, not context length.
        """
        table = seq.block_table
        rec = self._rows.get(seq.seq_id)
        if rec is None or rec[1] is not table or rec[2] > len(table):
            if rec is not None:
                self._free_rows.append(rec[0])
            if not self._free_rows:
                self._grow_rows()
            rec = [self._free_rows.pop(), table, 0]
            self._rows[seq.seq_id] = rec
        row, _, written = rec
        if written < len(table):
            if len(table) > self._tables.shape[2]:
                self._grow_width(len(table))
            for g, group_table in enumerate(seq.block_tables):
                # A freed entry (NULL, -1) is never read: any valid id stands in.
                new = torch.tensor(group_table[written:], dtype=torch.int32).clamp_(min=0)
                self._tables[g, row, written : len(table)] = new
            rec[2] = len(table)
            self._tables_dirty = True
        return row

    def release(self, seq_id: str) -> None:
        """A finished or aborted sequence gives its table row back."""
        rec = self._rows.pop(seq_id, None)
        if rec is not None:
            self._free_rows.append(rec[0])

    def _grow_rows(self) -> None:
        n = self._tables.shape[1]
        self._tables = torch.cat([self._tables, torch.zeros_like(self._tables)], dim=1)
        self._free_rows.extend(range(2 * n - 1, n - 1, -1))
        self._tables_dirty = True

    def _grow_width(self, need: int) -> None:
        groups, rows, width = self._tables.shape
        wider = torch.zeros(groups, rows, max(need, 2 * width), dtype=torch.int32)
        wider[:, :, :width] = self._tables
        self._tables = wider
        self._tables_dirty = True

    def _device_tables(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return self._tables
        if self._tables_dirty or self._tables_dev is None or self._tables_dev.shape != self._tables.shape:
            self._tables_dev = self._tables.to(self.device, non_blocking=True)
        self._tables_dirty = False
        return self._tables_dev

    def prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids, positions, attention metadata, and the rows whose logits are sampled.

        Decodes (single-token chunks) must come first in `batch`.
        """
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        b = 0
        while b < len(batch) and batch[b].num_tokens == 1:
            b += 1
        rows = [self._row(s.seq) for s in batch]
        if self.groups.hybrid:
            return self._prepare_groups(batch, rows, b)
        tables = self._device_tables()[0]
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=b)
        bs = self.block_size
        slots: list[torch.Tensor] = []
        if b:
            ctx = [s.seq.num_computed_tokens + 1 for s in batch[:b]]
            for i, s in enumerate(batch[:b]):
                ids.append(s.seq.token_ids[ctx[i] - 1])
                pos.append(ctx[i] - 1)
                if s.samples:  # a 1-token prefill remainder does not sample
                    sample_rows.append(i)
            rows_t = torch.tensor(rows[:b], dtype=torch.int32)
            ctx_t = torch.tensor(ctx, dtype=torch.int32)
            if self.native_decode:
                cfg = self.cfg
                meta.decode_call = native.DecodeCall(
                    tables, rows_t, ctx_t, max(ctx), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bs
                )
            else:
                max_blocks = -(-max(ctx) // bs)
                dec_tables = tables.index_select(0, rows_t.to(self.device))[:, :max_blocks].long()
                ctx_d = ctx_t.to(self.device).long()
                keys = torch.arange(max_blocks * bs, device=self.device)
                meta.decode_blocks = dec_tables
                meta.decode_mask = (keys.unsqueeze(0) < ctx_d.unsqueeze(1)).view(b, 1, 1, -1)
                last = ctx_d - 1
                slots.append(dec_tables.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs)
        row = b
        for s, table_row in zip(batch[b:], rows[b:], strict=True):
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_tokens
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            blocks = tables[table_row, : -(-end // bs)].long()
            p = torch.arange(start, end, device=self.device)
            slots.append(blocks[p // bs] * bs + p % bs)
            chunk = PrefillChunk(row, row + s.num_tokens, start)
            if start:
                chunk.context_blocks = blocks
                chunk.mask = torch.arange(end, device=self.device).unsqueeze(0) <= p.unsqueeze(1)
            meta.prefills.append(chunk)
            row += s.num_tokens
            if s.samples:
                sample_rows.append(row - 1)
        if slots:
            # With the kernel, decodes write their own K/V: slots cover the prefill rows only.
            meta.slot_mapping = torch.cat(slots)
        if self.native_decode and meta.prefills and len(ids) <= fused_decode.MAX_BATCH:
            meta.step_call = self._step_call(batch, rows, tables)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos_t = torch.tensor(pos, dtype=torch.long).to(self.device, non_blocking=True)
        return input_ids, pos_t, meta, sample_rows

    def _prepare_groups(
        self, batch: list[ScheduledSeq], rows: list[int], b: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """prepare() for a pool split into layer groups: one metadata per group."""
        ids: list[int] = []
        pos: list[int] = []
        spans: list[tuple[int, int]] = []
        sample_rows: list[int] = []
        row = 0
        for s in batch:
            start = s.seq.num_computed_tokens
            end = start + s.num_tokens
            ids.extend(s.seq.token_ids[start:end])
            pos.extend(range(start, end))
            spans.append((start, end))
            row += s.num_tokens
            if s.samples:
                sample_rows.append(row - 1)
        metas = group_metadata(
            self.groups, self._device_tables(), rows, spans, b, self.block_size, self.device, self.dtype
        )
        meta = metas[0]
        meta.groups = metas
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos_t = torch.tensor(pos, dtype=torch.long).to(self.device, non_blocking=True)
        return input_ids, pos_t, meta, sample_rows

    def _step_call(self, batch: list[ScheduledSeq], rows: list[int], tables: torch.Tensor) -> native.DecodeCall:
        """A row per token of a step with prefill chunks, for the fused whole-step kernel:
        a chunk's token at position p is a decode-like row with context p + 1 in its
        sequence's table. Why: the per-op path adds a fixed cost of op overheads to a
        prefill-carrying step on top of its matmuls, whatever the chunk's size, so the
        small chunks that keep a step under an ITL target would pay mostly that."""
        row_of: list[int] = []
        ctx: list[int] = []
        for s, table_row in zip(batch, rows, strict=True):
            start = s.seq.num_computed_tokens
            row_of.extend([table_row] * s.num_tokens)
            ctx.extend(range(start + 1, start + s.num_tokens + 1))
        cfg = self.cfg
        return native.DecodeCall(
            tables,
            torch.tensor(row_of, dtype=torch.int32),
            torch.tensor(ctx, dtype=torch.int32),
            max(ctx),
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.block_size,
        )

    def _logits_of_all(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(ids, positions, self.kv_cache, meta, self.kv_scale)
        return self.model.compute_logits(hidden).float()

    def _run_graph(self, batch: list[ScheduledSeq]) -> torch.Tensor | None:
        """A decode-only step through the decode graphs (None: not such a step, or no bucket)."""
        graphs = self.decode_graphs
        if graphs is None or self.native_decode or any(s.num_tokens != 1 for s in batch):
            return None
        rows = torch.tensor([self._row(s.seq) for s in batch], device=self.device)
        tables = self._device_tables()[0].index_select(0, rows)
        ctx = [s.seq.num_computed_tokens + 1 for s in batch]
        ids = [s.seq.token_ids[c - 1] for s, c in zip(batch, ctx, strict=True)]
        logits = graphs.run(ids, ctx, tables)
        if logits is None:
            return None
        keep = [i for i, s in enumerate(batch) if s.samples]
        if len(keep) == len(batch):
            return logits.clone()  # the graph's buffer is overwritten by the next replay
        return logits.index_select(0, torch.tensor(keep, device=self.device))

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Runs one step; returns float32 logits [num sampled rows, vocab] in sample order."""
        logits = self._run_graph(batch)
        if logits is not None:
            return logits
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.kv_scale)
        if not sample_rows:
            return torch.empty(0, self.cfg.vocab_size)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()

    def extra_stats(self) -> dict[str, float]:
        """Gauges for EngineStats.extra: KV bytes per token (scales included), the weights'
        bytes (scales included, measured at load) and nominal bits, and, when weights are
        offloaded, the offload's size and its per-step copy cost."""
        layout = self.kv_layout
        out = {
            # every layer's bytes (a block spans one group's layers)
            "kv_bytes_per_token": float(layout.bytes_per_token() * self.groups.num_groups),
            "kv_quantized": float(layout.quantization != "none"),
            "weight_bytes": float(self._weight_bytes),
            "weight_bits": float(WEIGHT_BITS.get(self.weight_dtype, self.dtype.itemsize * 8)),
        }
        offloader = self.model.weight_offloader
        if offloader is not None:
            out.update(offloader.stats().as_gauges())
        return out
