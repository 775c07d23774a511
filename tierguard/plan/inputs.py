"""What `tierguard plan` takes, and the checks that turn bad values into one clear error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierguard.common.errors import TierguardError
from tierguard.plan.config import ModelSpec

ENGINES = ("vllm", "sglang", "llamacpp", "tierguard")
STANDARD_CONTEXTS = (2048, 8192, 32768, 131072)


@dataclass
class PlanInputs:
    """Everything `tierguard plan` takes; sizes in GiB as users type them."""

    model: str | ModelSpec
    gpu: str | None = None
    gpu_mem_gib: float | None = None
    tp: int = 1
    pp: int = 1
    host_ram_gib: float | None = None
    nvme_gib: float | None = None
    engine: str | None = None  # None: vllm, or tierguard with target "cpu"
    kv_dtype: str = "auto"
    weights_dtype: str = "auto"
    block_size: int | None = None  # None: the engine's default (16; vLLM on CPU: 128)
    gpu_memory_utilization: float = 0.9
    # None: the engine's default (vLLM: by version and GPU, plan/reserves.py; others 8192 / 256).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    contexts: list[int] | None = None
    concurrency: int = 1
    output_len: int = 0
    trim_to: int | None = None
    shared_prefix: int = 0
    min_concurrency: int | None = None
    allow_kv_quant: bool = True
    kv_offload_gib: float | None = None
    weights_offload_gib: float | None = None
    offload: str = "none"
    pinned_cap_gib: float | None = None
    hybrid_allocator: bool = True
    prefix_caching: bool = False
    cuda_graph_in_budget: bool = False
    model_dirs: list[str] = field(default_factory=list)
    engine_version: str | None = None  # vLLM version whose rules to mirror; None = newest
    target: str = "gpu"  # "cpu": plan `tierguard serve` in this machine's RAM
    reserve_fit: Any = None  # fitted Reserves to use instead of the shipped fit (leave-one-out)
    kv_cache_gib: float | None = None  # --engine vllm --target cpu: VLLM_CPU_KVCACHE_SPACE


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TierguardError(f"{what} must be a positive whole number, got {value!r}")
    return value


def _positive(value: float | None, what: str) -> None:
    if value is not None and not value > 0:
        raise TierguardError(f"{what} must be positive, got {value}")


def validate(p: PlanInputs, spec: ModelSpec) -> tuple[list[int], int]:
    for v, what in (
        (p.tp, "--tp"),
        (p.pp, "--pp"),
        (p.block_size, "--block-size"),
        (p.concurrency, "--concurrency"),
    ):
        _positive_int(v, what)
    for v, what in ((p.max_num_batched_tokens, "--max-num-batched-tokens"), (p.max_num_seqs, "--max-num-seqs")):
        if v is not None:
            _positive_int(v, what)
    if p.target not in ("gpu", "cpu"):
        raise TierguardError(f"--target must be gpu or cpu, got {p.target!r}")
    if p.target == "cpu":
        if p.gpu is not None or p.gpu_mem_gib is not None:
            raise TierguardError("--target cpu plans host RAM for `tierguard serve`: drop --gpu / --gpu-mem-gib")
        if p.engine not in ("tierguard", "vllm"):
            raise TierguardError(f"--target cpu plans `tierguard serve` or vLLM's CPU backend; --engine {p.engine} runs on GPUs")
        if p.tp * p.pp != 1:
            raise TierguardError("--target cpu runs one process: --tp and --pp must be 1")
    for v, what in (
        (p.host_ram_gib, "--host-ram-gib"),
        (p.nvme_gib, "--nvme-gib"),
        (p.kv_offload_gib, "--kv-offload-gib"),
        (p.weights_offload_gib, "--weights-offload-gib"),
        (p.pinned_cap_gib, "--pinned-cap-gib"),
    ):
        _positive(v, what)
    if not 0 < p.gpu_memory_utilization <= 1:
        raise TierguardError(f"--gpu-memory-utilization must be in (0, 1], got {p.gpu_memory_utilization}")
    if p.output_len < 0:
        raise TierguardError(f"--output-len must not be negative, got {p.output_len}")
    if p.engine not in ENGINES:
        raise TierguardError(f"unknown engine {p.engine!r}: choose one of {', '.join(ENGINES)}")
    if p.kv_cache_gib is not None and not (p.engine == "vllm" and p.target == "cpu"):
        raise TierguardError("--kv-cache-gib sizes vLLM's CPU pool: it needs --engine vllm --target cpu")
    if p.offload not in ("none", "kv", "weights", "both"):
        raise TierguardError(f"--offload must be none, kv, weights or both, got {p.offload!r}")
    if spec.num_heads % p.tp:
        raise TierguardError(f"--tp {p.tp} does not divide the model's {spec.num_heads} attention heads")
    if p.pp > spec.num_layers:
        raise TierguardError(f"--pp {p.pp} exceeds the model's {spec.num_layers} layers")
    max_pos = spec.max_position_embeddings
    if p.max_model_len is not None:
        _positive_int(p.max_model_len, "--max-model-len")
    # The tightest length limit; 2**62 stands for "none given" (no max_pos, no --max-model-len).
    cap = min(x for x in (max_pos, p.max_model_len, 2**62) if x is not None)
    if p.output_len >= cap:
        raise TierguardError(f"--output-len {p.output_len} leaves no room for a prompt")
    contexts = list(p.contexts or [])
    if not contexts:
        # R9: 2k, 8k, 32k and the product maximum, as far as the model (and max_model_len) allow.
        limit = cap - p.output_len
        contexts = [c for c in STANDARD_CONTEXTS if c <= limit]
        if limit < 2**61 and limit > max(contexts, default=0):
            contexts.append(limit)
    for c in contexts:
        _positive_int(c, "--context")
        if max_pos is not None and c + p.output_len > max_pos:
            extra = f" + output {p.output_len}" if p.output_len else ""
            raise TierguardError(f"context {c}{extra} exceeds the model's max_position_embeddings {max_pos}")
    longest = max(contexts) + p.output_len
    mml = p.max_model_len if p.max_model_len is not None else longest
    _positive_int(mml, "--max-model-len")
    if max_pos is not None and mml > max_pos:
        raise TierguardError(f"--max-model-len {mml} exceeds the model's max_position_embeddings {max_pos}")
    if longest > mml:
        raise TierguardError(f"context {max(contexts)} + output {p.output_len} exceeds --max-model-len {mml}")
    for v, what in ((p.trim_to, "--trim-to"), (p.min_concurrency, "--min-concurrency")):
        if v is not None:
            _positive_int(v, what)
    if p.shared_prefix < 0:
        raise TierguardError(f"--shared-prefix must not be negative, got {p.shared_prefix}")
    return sorted(set(contexts)), mml
