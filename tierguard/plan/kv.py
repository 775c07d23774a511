"""KV-cache bytes per token and per sequence, per layer kind, as paged engines count them.

Invariants:
- A full-attention or MLA layer holds ceil(L / block_size) pages for a context of L.
- A sliding layer holds at most ceil(min(window - 1 + batched, L) / block_size) + 1
  pages; a chunked layer ceil(min(chunk + batched, L) / block_size) (no extra page).
  With the hybrid allocator off, both are charged like full layers.
- Mamba / linear-attention layers hold a constant state per sequence.
- Under TP each rank holds max(1, kv_heads // tp) heads (replicated when tp > heads);
  an MLA latent is replicated on every rank. Under PP the worst stage decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierguard.plan.config import ModelSpec
from tierguard.plan.dtypes import FP8_DS_MLA_BYTES_PER_TOKEN_LAYER, KVFormat, model_dtype

_STATE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2}
GROWING = ("full", "mla")
ATTENTION = ("full", "mla", "sliding", "chunked")


@dataclass(frozen=True)
class KVSettings:
    fmt: KVFormat
    max_model_len: int
    tp: int = 1
    pp: int = 1
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    hybrid_allocator: bool = True  # False: sliding/chunked layers charged like full ones
    prefix_caching: bool = False  # constant-state layers keep one extra state page


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges per pipeline stage; sizes differ by at most one."""
    base, rem = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s >= pp - rem else 0)  # remainder goes to the last stages
        out.append(range(start, start + n))
        start += n
    return out


class KVModel:
    """Byte counts for one model under one set of engine settings."""

    def __init__(self, spec: ModelSpec, settings: KVSettings) -> None:
        self.spec = spec
        self.s = settings
        self.stages = stage_layers(spec.num_layers, settings.pp)

    # ---- per token, per layer -------------------------------------------------------
    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.spec.num_kv_heads // self.s.tp)

    @property
    def replication(self) -> float:
        """Logical copies of attention KV the cluster holds (1.0 unless tp > kv heads)."""
        if self.spec.mla is not None:
            return float(self.s.tp)
        return self.kv_heads_per_rank * self.s.tp / self.spec.num_kv_heads

    def layer_token_bytes(self, kind: str, per_rank: bool = True) -> int:
        """Bytes one token adds to one layer (0 for constant-state and cache-less layers)."""
        fmt = self.s.fmt
        if kind == "mla":
            mla = self.spec.mla
            if fmt.name == "fp8_ds_mla":
                return FP8_DS_MLA_BYTES_PER_TOKEN_LAYER
            return fmt.bytes_for(mla.kv_lora_rank + mla.qk_rope_head_dim) + fmt.scale_bytes_per_token_head
        if kind not in ATTENTION:
            return 0
        heads = self.kv_heads_per_rank if per_rank else self.spec.num_kv_heads
        width = heads * self.spec.head_dim
        return 2 * fmt.bytes_for(width) + 2 * heads * fmt.scale_bytes_per_token_head

    def _growing(self, kind: str) -> bool:
        """Full/MLA layers grow; a capped layer grows only if its cap never bites below max_model_len."""
        if kind in GROWING:
            return True
        if kind not in ("sliding", "chunked"):
            return False
        return self.pages(kind, self.s.max_model_len) == math.ceil(self.s.max_model_len / self.s.block_size)

    def bytes_per_token(self) -> int:
        """Per-token growth of one logical copy (TP=1), only layers that grow with context.

        A sliding or chunked layer whose engine cap (window - 1 + batched tokens) is not
        below max_model_len is charged for every token, so it counts as growing.
        """
        return sum(
            self.layer_token_bytes(k, per_rank=False) for k in self.spec.layer_kinds if self._growing(k)
        )

    def bytes_per_token_per_gpu(self) -> int:
        kinds = self.spec.layer_kinds
        return max(
            sum(self.layer_token_bytes(kinds[i]) for i in st if self._growing(kinds[i])) for st in self.stages
        )

    def bytes_per_token_all_layers_per_gpu(self) -> int:
        """Every attention layer charged per token: how vLLM's "GPU KV cache size: N tokens"
        line converts its available memory (checked on gemma-2 and gpt-oss logs, whose
        sliding layers count like full ones in that line)."""
        kinds = self.spec.layer_kinds
        return max(sum(self.layer_token_bytes(kinds[i]) for i in st) for st in self.stages)

    # ---- per sequence ----------------------------------------------------------------
    def pages(self, kind: str, context: int) -> int:
        bs = self.s.block_size
        full = math.ceil(context / bs)
        if kind == "sliding" and self.s.hybrid_allocator:
            kept = min(self.spec.sliding_window - 1 + self.s.max_num_batched_tokens, context)
            return min(full, math.ceil(kept / bs) + 1)
        if kind == "chunked" and self.s.hybrid_allocator:
            kept = min(self.spec.chunk_size + self.s.max_num_batched_tokens, context)
            return min(full, math.ceil(kept / bs))
        return full

    def state_bytes(self, kind: str, per_rank: bool = True) -> int:
        """Constant state of one sequence in one Mamba / linear layer."""
        conv, rec = self.spec.state_elems.get(kind, (0, 0))
        dtype = self.spec.state_dtype or model_dtype(self.spec.torch_dtype)
        elem = _STATE_BYTES.get(str(dtype).lower(), 2)
        tp = self.s.tp if per_rank else 1
        copies = 2 if self.s.prefix_caching else 1
        return copies * elem * (math.ceil(conv / tp) + math.ceil(rec / tp))

    def _layer_seq_bytes(self, kind: str, context: int, per_rank: bool) -> int:
        if kind in ("mamba", "linear"):
            return self.state_bytes(kind, per_rank)
        if kind == "none":
            return 0
        return self.pages(kind, context) * self.s.block_size * self.layer_token_bytes(kind, per_rank)

    def sequence_bytes(self, context: int) -> int:
        """One sequence at `context` tokens, one logical copy (TP=1), block-rounded."""
        return sum(self._layer_seq_bytes(k, context, False) for k in self.spec.layer_kinds)

    def sequence_bytes_per_gpu(self, context: int) -> int:
        """One sequence on the most loaded GPU (worst pipeline stage, one TP rank)."""
        kinds = self.spec.layer_kinds
        return max(sum(self._layer_seq_bytes(kinds[i], context, True) for i in st) for st in self.stages)

    def shared_prefix_bytes_per_gpu(self, prefix: int) -> int:
        """What one more sequence sharing a `prefix`-token prefix does NOT need to store.

        Prefix caching shares full blocks of growing layers only; sliding windows and
        constant states are per sequence.
        """
        blocks = prefix // self.s.block_size
        return blocks * self.s.block_size * self.bytes_per_token_per_gpu()

    def max_context(self, budget_per_gpu: int, sessions: int, hi: int) -> int:
        """Largest context (multiple of block_size, <= hi) such that `sessions` fit."""
        bs = self.s.block_size
        lo_b, hi_b = 0, hi // bs
        while lo_b < hi_b:
            mid = (lo_b + hi_b + 1) // 2
            if sessions * self.sequence_bytes_per_gpu(mid * bs) <= budget_per_gpu:
                lo_b = mid
            else:
                hi_b = mid - 1
        return lo_b * bs
