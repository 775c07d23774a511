"""Decode-only steps on static buffers, captured once per shape in a CUDA graph.

Why: a small model's decode step on a GPU is hundreds of tiny kernel launches; Python
and launch overhead, not the GPU, set its time. A CUDA graph replays all of them with
one launch. Graphs need fixed shapes and addresses, so a decode-only step of B sequences
runs on the buffers of the smallest captured batch size >= B (`BATCH_SIZES`) and the
smallest power-of-two block count >= its longest context; the extra rows are padding:
token 0 at position 0 whose K/V land in a scratch block no sequence owns (the runner
allocates it; see ModelRunner) and whose logits are dropped.

Everything a step changes is copied into the buffers (ids, positions, block tables,
context lengths); slots and the key mask are computed inside the graph from them. The
same code runs eagerly where graphs are off (the CPU, in tests), so the static-buffer
path is tested without a GPU; bench/gpu_check.sh checks the captured graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierguard.model.attention import AttentionMetadata

BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class _Static:
    ids: torch.Tensor  # [B] long
    pos: torch.Tensor  # [B] long
    tables: torch.Tensor  # [B, nb] long
    ctx: torch.Tensor  # [B] long
    logits: torch.Tensor | None = None  # [B, vocab] float32, the graph's output
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        block_size: int,
        max_blocks: int,
        scratch_block: int,
        device: torch.device,
        max_batch: int,
        capture: bool,
    ) -> None:
        """`forward(ids, positions, meta) -> float32 logits of every row`."""
        self.forward = forward
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.device = device
        self.sizes = tuple(b for b in BATCH_SIZES if b <= max_batch)
        self.capture = capture
        self._static: dict[tuple[int, int], _Static] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_captured = 0
        self.num_replays = 0

    def bucket(self, batch: int, blocks: int) -> tuple[int, int] | None:
        """(batch size, block count) of the buffers that fit, or None (run eagerly)."""
        size = next((b for b in self.sizes if b >= batch), None)
        if size is None or blocks > self.max_blocks:
            return None
        nb = 1
        while nb < blocks:
            nb *= 2
        return size, min(nb, self.max_blocks)

    def run(self, ids: list[int], ctx: list[int], tables: torch.Tensor) -> torch.Tensor | None:
        """Logits [len(ids), vocab] of a decode-only step, or None when no bucket fits.
        `tables`: [len(ids), >= blocks] int block tables (any device)."""
        b = len(ids)
        blocks = -(-max(ctx) // self.block_size)
        key = self.bucket(b, blocks)
        if key is None:
            return None
        st = self._static.get(key) or self._make(key)
        size, nb = key
        st.ids[:b].copy_(torch.tensor(ids), non_blocking=True)
        st.ids[b:].zero_()
        c = torch.tensor(ctx)
        st.ctx[:b].copy_(c, non_blocking=True)
        st.ctx[b:].fill_(1)
        st.pos.copy_(st.ctx - 1)
        st.tables[:b].copy_(tables[:, :nb].to(st.tables.device, torch.long), non_blocking=True)
        st.tables[b:].fill_(self.scratch_block)
        if st.graph is not None:
            st.graph.replay()
            self.num_replays += 1
            logits = st.logits
        else:
            logits = self._body(st)
        return logits[:b]

    def _body(self, st: _Static) -> torch.Tensor:
        bs = self.block_size
        last = st.ctx - 1
        slots = st.tables.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs
        keys = torch.arange(st.tables.shape[1] * bs, device=st.ctx.device)
        mask = (keys.unsqueeze(0) < st.ctx.unsqueeze(1)).view(st.ctx.shape[0], 1, 1, -1)
        meta = AttentionMetadata(
            slot_mapping=slots, num_decodes=st.ctx.shape[0], decode_blocks=st.tables, decode_mask=mask
        )
        return self.forward(st.ids, st.pos, meta)

    def _make(self, key: tuple[int, int]) -> _Static:
        size, nb = key
        dev = self.device
        st = _Static(
            ids=torch.zeros(size, dtype=torch.long, device=dev),
            pos=torch.zeros(size, dtype=torch.long, device=dev),
            tables=torch.full((size, nb), self.scratch_block, dtype=torch.long, device=dev),
            ctx=torch.ones(size, dtype=torch.long, device=dev),
        )
        if self.capture:
            # Warm up on a side stream (allocator, cuBLAS handles), then capture.
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._body(st)
            torch.cuda.current_stream(dev).wait_stream(side)
            st.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(st.graph, pool=self._pool):
                st.logits = self._body(st)
            self.num_captured += 1
        self._static[key] = st
        return st
