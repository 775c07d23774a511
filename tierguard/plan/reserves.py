"""What vLLM takes out of `total x gpu_memory_utilization` before the KV pool, by version.

    budget = total x utilization
    KV     = budget - weights - activation peak - non-torch - (CUDA graphs, from 0.21)

Rules that change with the version (each band is the first version it starts at):

  0.6   V0 engine. The profile run is one prefill of max_num_batched_tokens
        (= max(max_model_len, 2048) without chunked prefill) over 256 sequences.
        CUDA graphs are captured after the KV pool is sized, outside the budget.
  0.8   V1 engine. `vllm serve` picks max_num_batched_tokens / max_num_seqs by GPU:
        8192 / 1024 on >= 70 GiB GPUs other than A100 (0.9+), else 2048 / 256.
        A dummy sampler run over max_num_seqs rows of full-vocabulary logits usually
        sets the peak (~39 bytes per logit in 0.11).
  0.12  Same accounting; the sampler's dummy run peaks at ~14.5 bytes per logit
        (0.19 logs). The exact release of that change is unknown: it lies in
        (0.11.0, 0.19.0] and 0.12 is where this band starts by assumption.
  0.21  The estimated CUDA-graph memory is subtracted too ("CUDA graph memory
        profiling is enabled (default since v0.21.0)"); 0.19 only logs the estimate.

Mechanism here, numbers elsewhere: the coefficients that turn model features into
bytes are fitted from public startup logs (plan/calibration.py), never typed in.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.plan.config import ModelSpec


@dataclass(frozen=True)
class Band:
    name: str  # the first version of the band, e.g. "0.12"
    first: tuple[int, int, int]
    engine: str  # "V0" or "V1"
    graphs_in_budget: bool
    note: str


BANDS: tuple[Band, ...] = (
    Band("0.6", (0, 6, 0), "V0", False, "V0 engine; CUDA graphs outside the budget"),
    Band("0.8", (0, 8, 0), "V1", False, "V1 engine; sampler dummy run ~39 B/logit"),
    Band("0.12", (0, 12, 0), "V1", False, "V1; sampler dummy run ~14.5 B/logit; graphs only estimated"),
    Band("0.21", (0, 21, 0), "V1", True, "V1; estimated CUDA-graph memory subtracted from the budget"),
)
NEWEST = BANDS[-1]
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class EngineRules:
    """The vLLM version a plan mirrors and the band of rules it falls in."""

    version: str  # as given, or "newest"
    band: Band

    @property
    def v1(self) -> bool:
        return self.band.engine == "V1"


def parse_version(text: str) -> tuple[int, int, int]:
    m = _VERSION.match(str(text).strip())
    if not m:
        raise TierguardError(f"--engine-version {text!r} is not a version like 0.19.0")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def engine_rules(version: str | None) -> EngineRules:
    """Rules for `--engine-version` (None, "newest" or "latest": the newest band)."""
    if version is None or str(version).strip().lower() in ("", "newest", "latest"):
        return EngineRules("newest", NEWEST)
    v = parse_version(version)
    if v < BANDS[0].first:
        raise TierguardError(
            f"--engine-version {version}: no rules for vLLM older than 0.6 (the calibration starts at 0.6.4)"
        )
    band = [b for b in BANDS if b.first <= v][-1]
    return EngineRules(str(version).strip(), band)


def default_batching(
    rules: EngineRules, gpu_name: str, gpu_total_bytes: int, max_model_len: int
) -> tuple[int, int, str]:
    """`vllm serve` defaults for (max_num_batched_tokens, max_num_seqs) and why.

    V0: chunked prefill only above 32k context (then 512 tokens per step); otherwise
    the whole max_model_len (at least 2048) in one step; 256 sequences. V1: usage-context
    defaults by GPU (vLLM PRs #12369, #17073, #17885).
    """
    if not rules.v1:
        if max_model_len > 32768:
            return 512, 256, "V0: chunked prefill on above 32k context, 512 tokens per step"
        return max(max_model_len, 2048), 256, "V0: one prefill of max(max_model_len, 2048) tokens"
    v = parse_version(rules.version) if rules.version != "newest" else (99, 0, 0)
    name = gpu_name.lower()
    big = gpu_total_bytes >= 70 * GIB
    if v < (0, 8, 5):
        fast = "h100" in name or "h200" in name
        return (8192 if fast else 2048), 256, "V1 serve default (H100/H200: 8192 tokens)"
    if v < (0, 9, 0):
        return (8192, 1024, "V1 serve default for >= 70 GiB GPUs") if big else (2048, 256, "V1 serve default")
    if big and "a100" not in name:
        return 8192, 1024, "V1 serve default for >= 70 GiB GPUs other than A100"
    return 2048, 256, "V1 serve default"


@dataclass(frozen=True)
class Features:
    """Model- and setting-dependent quantities the fitted coefficients multiply."""

    forward_bytes: float  # live rows of the profile forward over max_num_batched_tokens
    logits: float  # max_num_seqs x vocab: the sampler dummy run
    graph_layers: int  # decoder layers on the most loaded GPU


def features(
    spec: ModelSpec, tp: int, pp: int, batched_tokens: int, max_num_seqs: int, act_bytes: int
) -> Features:
    """Forward: the widest projection (3 MLP-intermediate rows, or the QKV row) and ~3 hidden
    rows per token are alive at the peak; a fused MoE layer also keeps top-k hidden rows."""
    h = spec.hidden_size
    widths = []
    if spec.moe is None or spec.moe.dense_layers:
        widths.append(spec.intermediate_size)
    moe_rows = 0
    if spec.moe is not None:
        widths.append(spec.moe.experts_per_tok * spec.moe.expert_intermediate + spec.moe.shared_intermediate)
        moe_rows = spec.moe.experts_per_tok * h
    mlp = 3 * max(widths) / tp
    attn = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim / tp
    per_token = max(mlp, attn) + 3 * h + moe_rows
    layers = math.ceil(spec.num_layers / pp)
    return Features(batched_tokens * per_token * act_bytes, float(max_num_seqs) * spec.vocab_size, layers)


@dataclass(frozen=True)
class Reserves:
    """Fitted coefficients of one version band (bytes)."""

    band: str
    forward_scale: float
    bytes_per_logit: float
    activation_offset: float
    non_torch_single: float  # one GPU, or pipeline stages without tensor parallelism
    non_torch_tp: float  # tensor parallel: NCCL and custom all-reduce buffers
    graph_offset: float  # the logged "Estimated CUDA graph memory" = offset + per layer x layers
    graph_bytes_per_layer: float
    rows: dict[str, int]  # how many log rows each quantity was fitted from

    def activation(self, f: Features) -> int:
        return int(
            max(self.forward_scale * f.forward_bytes, self.bytes_per_logit * f.logits)
            + self.activation_offset
        )

    def non_torch(self, tp: int) -> int:
        return int(self.non_torch_tp if tp > 1 else self.non_torch_single)

    def cuda_graphs(self, f: Features) -> int:
        return int(self.graph_offset + self.graph_bytes_per_layer * f.graph_layers)
