"""`--engine vllm --target cpu`: the KV pool vLLM's CPU backend builds, as its start-up logs it.

vLLM on CPU does not profile memory when the KV size is explicit: the pool is
`VLLM_CPU_KVCACHE_SPACE` GiB (whole GiB only; `--kv-cache-memory-bytes` for any other
size) and everything below follows from the model and the flags, so the plan predicts
the two figures of vLLM's line

    CPU KV cache size: 23,296 tokens, Maximum concurrency for 4,096 tokens per request: 5.69x

exactly, by the same integer steps (vLLM 0.32, v1/core/kv_cache_utils.py):

- dtype: `--dtype auto` takes the config's dtype, except that a float32 checkpoint is
  served in bfloat16 (the platform's preferred dtype); the KV cache has the model dtype
  unless `--kv-cache-dtype fp8*` (1 byte).
- block: 128 tokens unless `--block-size` (the CPU attention kernel takes multiples of 32);
  a block of all layers = layers x block x kv_heads x 2 x head_dim x dtype bytes.
- blocks = pool bytes // block bytes; a request at max_model_len needs
  ceil(max_model_len / block) of them; concurrency = blocks / that (a float);
  tokens = int(concurrency x max_model_len).
- fp8 KV needs a head_dim divisible by 32 (and AVX-512 or AMX) on CPU.
- vLLM refuses to start when one request at max_model_len needs more than the pool less
  one block (the null block it keeps back).

Only models whose every layer is full attention are mirrored: sliding, chunked, MLA and
constant-state layers go through vLLM's hybrid grouping, which this module does not model.
"""

from __future__ import annotations

import math
import os
import shlex

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.plan.config import ModelSpec

CPU_BLOCK_SIZE = 128  # vLLM's CPU default when --block-size is not given
KERNEL_BLOCK_MULTIPLE = 32  # CPU attention's kernel block sizes: multiples of 32
VLLM_VERSION = "0.32"  # the vLLM whose CPU rules this mirrors
_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}  # fmt: skip
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


def serving_dtype(requested: str, config_dtype: str | None) -> str:
    """The dtype vLLM's CPU backend computes in for `--dtype requested`."""
    req = requested.strip().lower()
    if req == "auto":
        conf = _DTYPES.get(str(config_dtype or "float32").lower(), "float32")
        return "bfloat16" if conf == "float32" else conf  # float32 checkpoints are downcast
    if req not in _DTYPES:
        raise TierguardError(f"--dtype {requested!r}: vLLM on CPU serves float32, bfloat16 or float16 (or auto)")
    return _DTYPES[req]


def kv_dtype_bytes(kv_dtype: str, dtype: str) -> tuple[str, int]:
    kv = kv_dtype.strip().lower()
    if kv == "auto":
        return dtype, _BYTES[dtype]
    if kv in _FP8:
        return kv, 1
    raise TierguardError(f"--kv-dtype {kv_dtype!r}: vLLM's CPU attention stores auto, fp8, fp8_e4m3 or fp8_e5m2")


def kv_pool_bytes(gib: float) -> tuple[int, dict[str, str], list[str]]:
    """Pool bytes and how to ask for them: the env var for whole GiB, the flag otherwise."""
    if not gib > 0 or not math.isfinite(gib):
        raise TierguardError(f"--kv-cache-gib must be a positive number, got {gib}")
    if float(gib).is_integer():
        return int(gib) * GIB, {"VLLM_CPU_KVCACHE_SPACE": str(int(gib))}, []
    nbytes = int(gib * GIB)
    return nbytes, {}, ["--kv-cache-memory-bytes", str(nbytes)]  # the env var takes whole GiB only


def check_model(spec: ModelSpec) -> None:
    kinds = sorted(set(spec.layer_kinds) - {"full"})
    if kinds or spec.mla is not None:
        raise TierguardError(
            f"--engine vllm --target cpu mirrors models whose layers are all full attention; "
            f"{spec.name} has {', '.join(kinds or ['mla'])} layers"
        )


def capacity(spec: ModelSpec, pool_bytes: int, kv_bytes: int, block_size: int, max_model_len: int) -> dict:
    """vLLM's figures for one pool, in its own order of integer and float steps."""
    page = block_size * spec.num_kv_heads * 2 * spec.head_dim * kv_bytes  # one layer's block
    block_bytes = spec.num_layers * page
    num_blocks = pool_bytes // block_bytes
    per_request = -(-max_model_len // block_size)
    concurrency = num_blocks / per_request
    tokens = int(concurrency * max_model_len)
    # vLLM checks one request at max_model_len against the pool less the null block
    starts = per_request * block_bytes <= pool_bytes - block_bytes
    longest = max(0, (pool_bytes - block_bytes) // block_bytes) * block_size
    return {
        "block_size": block_size,
        "bytes_per_token": spec.num_layers * spec.num_kv_heads * 2 * spec.head_dim * kv_bytes,
        "block_bytes": block_bytes,
        "num_blocks": num_blocks,
        "blocks_per_request": per_request,
        "kv_cache_tokens": tokens,
        "max_concurrency": concurrency,
        "starts": starts,
        "longest_max_model_len": longest,
        "log_line": f"CPU KV cache size: {tokens:,} tokens, Maximum concurrency for "
        f"{max_model_len:,} tokens per request: {concurrency:.2f}x",
    }


def all_cores() -> str:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


def cpu_holds_fp8_kv(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether vLLM's CPU attention can keep an fp8 KV cache on this CPU: it needs x86 with
    AVX-512 or AMX (elsewhere its start-up fails). True where the flags cannot be read: a
    plan for another machine is not refused on a guess."""
    try:
        with open(cpuinfo) as f:
            flags = f.read().split()
    except OSError:
        return True
    return "avx512f" in flags or "amx_tile" in flags


def vllm_cpu_figures(
    spec: ModelSpec,
    *,
    kv_cache_gib: float | None,
    dtype: str = "auto",
    kv_dtype: str = "auto",
    block_size: int | None = None,
    max_model_len: int | None = None,
    model_path: str | None = None,
) -> dict:
    """The `vllm_cpu` part of a plan: figures, env, flags and the command that starts it."""
    if kv_cache_gib is None:
        raise TierguardError(
            "--engine vllm --target cpu needs --kv-cache-gib G (VLLM_CPU_KVCACHE_SPACE): without it vLLM "
            "sizes the pool from its own memory use at start-up, which no plan can predict exactly"
        )
    check_model(spec)
    served = serving_dtype(dtype, spec.torch_dtype)
    kv_name, kv_bytes = kv_dtype_bytes(kv_dtype, served)
    if kv_name in _FP8 and spec.head_dim % 32:
        raise TierguardError(
            f"--kv-dtype {kv_name}: vLLM's CPU attention stores fp8 KV only for head_dim divisible by 32; "
            f"{spec.name} has {spec.head_dim}"
        )
    bs = CPU_BLOCK_SIZE if block_size is None else block_size
    if bs % KERNEL_BLOCK_MULTIPLE:
        raise TierguardError(f"--block-size {bs}: vLLM's CPU attention takes blocks in multiples of 32")
    mml = max_model_len or spec.max_position_embeddings
    if not mml:
        raise TierguardError(f"{spec.name} has no max_position_embeddings: give --max-model-len")
    pool, env, pool_flags = kv_pool_bytes(kv_cache_gib)
    fig = capacity(spec, pool, kv_bytes, bs, mml)
    flags = ["--dtype", served, "--max-model-len", str(mml)]
    if block_size is not None:
        flags += ["--block-size", str(bs)]
    if kv_name in _FP8:
        flags += ["--kv-cache-dtype", kv_name]
    flags += pool_flags
    # Compute on every core: by default vLLM keeps one CPU back for its front end.
    env |= {"VLLM_CPU_OMP_THREADS_BIND": all_cores(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    model = model_path or spec.name
    command = " ".join(
        [*(f"{k}={shlex.quote(v)}" for k, v in env.items()), "python -m vllm.entrypoints.openai.api_server",
         "--model", shlex.quote(model), *map(shlex.quote, flags)]
    )
    return {
        "vllm_version": VLLM_VERSION,
        "dtype": served,
        "kv_cache_dtype": kv_name,
        "kv_cache_bytes": pool,
        "max_model_len": mml,
        **fig,
        "env": env,
        "flags": flags,
        "command": command,
    }
