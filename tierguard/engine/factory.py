"""Build an LLMEngine from a local model directory, sizing the KV pool from a budget.

KV budget: `kv_cache_gib` when given; otherwise a fraction of the memory free after the
weights are loaded (torch.cuda.mem_get_info on CUDA, psutil's available RAM on CPU).
On CPU the default is also capped (DEFAULT_CPU_KV_CAP_GIB) and never larger than what
max_num_seqs sequences of max_model_len tokens could use: host RAM is shared with the
OS, page cache and the tiers (MISSION R6), so the engine does not grab it all.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.engine.config import EngineConfig
from tierguard.engine.llm_engine import LLMEngine
from tierguard.engine.model_runner import KV_DTYPES, kv_block_bytes
from tierguard.engine.weight_offload import WeightOffloader
from tierguard.kv.weights_digest import weight_files, weights_digest
from tierguard.model.config import ModelConfig
from tierguard.model.gemma3 import kv_groups
from tierguard.model.loader import load_model
from tierguard.model.tokenizer import HFTokenizer

DEFAULT_CUDA_KV_FRACTION = 0.85
DEFAULT_CPU_KV_FRACTION = 0.10
DEFAULT_CPU_KV_CAP_GIB = 0.5
# Tokens per step when not given: a step's duration is an inter-token gap for every
# running stream, and a CPU computes prefill tokens far slower than a GPU, so chunks stay
# small there.
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}
# Steps that carry decodes stay under this (step_budget.py): on CPU a whole prefill chunk
# beside decodes is the gap every stream sees. 100 ms is the sweep's default ITL SLO.
# CUDA keeps whole chunks (its steps are short).
DEFAULT_TARGET_ITL_MS = {"cpu": 100.0, "cuda": 0.0}
# Prefill time a step with decodes may add, as a multiple of the decode time (step_budget.py).
DEFAULT_PREFILL_SHARE = 1.0


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def kv_budget_bytes(
    device: torch.device, kv_cache_gib: float | None, kv_cache_fraction: float | None, useful_bytes: int
) -> int:
    if kv_cache_gib is not None:
        if kv_cache_gib <= 0:
            raise TierguardError(f"--kv-cache-gib must be positive, got {kv_cache_gib}")
        return int(kv_cache_gib * GIB)
    default = DEFAULT_CUDA_KV_FRACTION if device.type == "cuda" else DEFAULT_CPU_KV_FRACTION
    fraction = default if kv_cache_fraction is None else kv_cache_fraction
    if not 0 < fraction <= 1:
        raise TierguardError(f"kv cache fraction must be in (0, 1], got {fraction}")
    budget = int(free_memory_bytes(device) * fraction)
    if device.type != "cuda":
        budget = min(budget, int(DEFAULT_CPU_KV_CAP_GIB * GIB), useful_bytes)
    return budget


def default_threads() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's
    limit, not the machine's core count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def set_threads(num_threads: int | None) -> int:
    """torch's intra-op threads (the matmuls and the C kernels share them): `--threads`,
    else TIERGUARD_NUM_THREADS, else every core in the affinity mask. Returns the count."""
    env = os.environ.get("TIERGUARD_NUM_THREADS")
    n = num_threads or (int(env) if env else default_threads())
    if n < 1:
        raise TierguardError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n


def weights_id(
    model_dir: Path,
    dtype: torch.dtype | str,
    weight_dtype: str = "auto",
    int4_group: int = 32,
    gguf_path: str | Path | None = None,
) -> str:
    """What the KV of this checkpoint depends on besides its config, for the fingerprint
    (tierguard/kv/spec.py): the SHA-256 of the weight files' content (and of the GGUF
    file the weights came from), the compute dtype and the weight quantization. Not the
    directory's name, sizes or mtimes: a fine-tune in the same directory is another id,
    the same weights under another path are the same. Digests are cached per file
    (tierguard/kv/weights_digest.py), so a restart does not read the weights again."""
    files = weight_files(model_dir) + ([Path(gguf_path)] if gguf_path is not None else [])
    quant = weight_dtype if weight_dtype != "int4" else f"int4/{int4_group}"
    return f"sha256:{weights_digest(files)};dtype:{str(dtype).removeprefix('torch.')};weights:{quant}"


def build_engine(
    model_dir: str | Path,
    *,
    dtype: str = "auto",
    device: str = "auto",
    kv_cache_gib: float | None = None,
    kv_cache_fraction: float | None = None,
    block_size: int = 16,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
    kv_host_gib: float = 0.0,
    kv_disk_dir: str | None = None,
    kv_disk_gib: float = 0.0,
    kv_media: dict[str, dict] | None = None,
    ttft_budget_ms: dict[str, float] | None = None,
    naive_sync_disk: bool = False,
    model_name: str | None = None,
    num_threads: int | None = None,
    kv_dtype: str = "auto",
    weights_offload_gib: float | None = None,
    weight_dtype: str = "auto",
    int4_group: int = 32,
    target_itl_ms: float | None = None,
    itl_slo_ms: float = 0.0,
    prefill_share: float | None = None,
    cuda_graphs: bool = True,
    gguf_path: str | Path | None = None,
    kv_encrypt_key_file: str | None = None,
    kv_encrypt_old_key_file: str | None = None,
    kv_disk_ttl_s: float = 0.0,
) -> LLMEngine:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)  # fail fast on a bad directory, before loading weights
    if max_model_len is None:
        max_model_len = cfg.max_exact_len
    if max_model_len > cfg.max_position_embeddings:
        raise TierguardError(
            f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})"
        )
    if max_model_len > cfg.max_exact_len:
        raise TierguardError(
            f"max_model_len ({max_model_len}) exceeds the model's sliding window ({cfg.sliding_window}); "
            "sliding-window attention is not implemented"
        )
    if block_size <= 0 or block_size & (block_size - 1):
        raise TierguardError(f"block size must be a positive power of two, got {block_size}")
    set_threads(num_threads)
    tokenizer = HFTokenizer(model_dir)
    if kv_dtype not in KV_DTYPES:
        raise TierguardError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if weights_offload_gib is not None and weights_offload_gib < 0:
        raise TierguardError(f"--weights-offload-gib must be >= 0, got {weights_offload_gib}")
    model, cfg, torch_dtype, dev = load_model(
        model_dir, dtype, device, weight_dtype=weight_dtype, int4_group=int4_group, gguf_path=gguf_path
    )
    # Weight offload has its own budget (R6); attached before the KV budget is measured,
    # so on CUDA the device memory it frees goes to the KV pool.
    WeightOffloader.attach(model, weights_offload_gib)
    per_block = kv_block_bytes(cfg, block_size, torch_dtype, kv_dtype)  # scales included
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(DEFAULT_BATCHED_TOKENS.get(dev.type, 512), max_num_seqs)
    # One sequence of max_model_len, every layer group (a sliding group holds its window
    # plus one step's chunk at most).
    min_blocks = kv_groups(cfg).sequence_blocks(max_model_len, max_num_batched_tokens, block_size)
    budget = kv_budget_bytes(dev, kv_cache_gib, kv_cache_fraction, max_num_seqs * min_blocks * per_block)
    num_blocks = budget // per_block
    if num_blocks < min_blocks:
        raise TierguardError(
            f"KV budget of {budget / GIB:.3f} GiB holds {num_blocks} blocks of {block_size} tokens, fewer than one "
            f"sequence of max_model_len {max_model_len} needs ({min_blocks}); raise --kv-cache-gib or lower --max-model-len"
        )
    config = EngineConfig(
        num_blocks=int(num_blocks),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        kv_host_gib=kv_host_gib,  # tiered KV store: tierguard/kv/connector.py
        kv_disk_dir=None if kv_disk_dir is None else str(kv_disk_dir),
        kv_disk_gib=kv_disk_gib,
        kv_media=dict(kv_media or {}),  # further cold media by registered name: tierguard/kv/media/base.py
        ttft_budget_ms=ttft_budget_ms,
        naive_sync_disk=naive_sync_disk,
        kv_dtype=kv_dtype,
        target_itl_ms=DEFAULT_TARGET_ITL_MS.get(dev.type, 0.0) if target_itl_ms is None else target_itl_ms,
        itl_slo_ms=itl_slo_ms,
        prefill_share=DEFAULT_PREFILL_SHARE if prefill_share is None else prefill_share,
        decode_graph_max_batch=min(32, max_num_seqs) if cuda_graphs and dev.type == "cuda" else 0,
        kv_encrypt_key_file=kv_encrypt_key_file,  # cold KV at rest: tierguard/kv/media/aead_codec.py
        kv_encrypt_old_key_file=kv_encrypt_old_key_file,
        kv_disk_ttl_s=kv_disk_ttl_s,
    )
    return LLMEngine(
        model,
        cfg,
        tokenizer,
        config,
        torch_dtype,
        dev,
        model_name=model_name or model_dir.resolve().name,
        weights_id=weights_id(model_dir, torch_dtype, weight_dtype, int4_group, gguf_path),
    )
