"""Engine flags for the chosen plan, and the TP trap (R3) spelled out.

Units differ per engine and per flag, which is the trap: vLLM `--cpu-offload-gb` is
weights in GiB PER GPU; `--kv-offloading-size` is KV in GiB in TOTAL across TP ranks;
LMCache's own CPU size is per rank; SGLang's `--mem-fraction-static` is
(weights + KV pool) / GPU memory; llama.cpp's `-c` is shared by all `-np` slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierguard.common.units import GIB


@dataclass(frozen=True)
class FlagFacts:
    """What the flags are built from; bytes are per GPU unless named total."""

    engine: str
    tp: int
    pp: int
    num_layers: int
    gmu: float
    max_model_len: int
    context: int
    sessions: int
    max_num_batched_tokens: int
    block_size: int
    kv_dtype: str  # format name after the ladder
    kv_quantized: bool
    prefix_caching: bool
    kv_offload_total_bytes: int
    weights_offload_per_gpu_bytes: int
    weights_per_gpu_bytes: int
    kv_pool_per_gpu_bytes: int
    gpu_total_bytes: int
    kv_disk_bytes: int = 0
    weight_dtype: str = "auto"  # tierguard serve --weight-dtype (int8/int4 quantized at load)


def _up(b: int, step: float = 0.1) -> str:
    return f"{math.ceil(b / GIB / step - 1e-9) * step:.{max(0, -int(math.floor(math.log10(step))))}f}"


def _down(b: int) -> str:
    return f"{math.floor(b / GIB * 100) / 100:.2f}"


def vllm_flags(f: FlagFacts) -> list[str]:
    out = []
    if f.tp > 1:
        out += ["--tensor-parallel-size", str(f.tp)]
    if f.pp > 1:
        out += ["--pipeline-parallel-size", str(f.pp)]
    out += [
        "--max-model-len",
        str(f.max_model_len),
        "--max-num-seqs",
        str(f.sessions),
        "--gpu-memory-utilization",
        f"{f.gmu:g}",
        "--max-num-batched-tokens",
        str(f.max_num_batched_tokens),
    ]
    if f.block_size != 16:
        out += ["--block-size", str(f.block_size)]
    if f.kv_quantized:
        name = f.kv_dtype if f.kv_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla") else "fp8"
        out += ["--kv-cache-dtype", name]
    if f.prefix_caching:
        out += ["--enable-prefix-caching"]
    if f.kv_offload_total_bytes:
        out += ["--kv-offloading-size", _up(f.kv_offload_total_bytes), "--kv-offloading-backend", "native"]
    if f.weights_offload_per_gpu_bytes:
        out += ["--cpu-offload-gb", _up(f.weights_offload_per_gpu_bytes)]
    return out


def sglang_flags(f: FlagFacts) -> list[str]:
    out = []
    if f.tp > 1:
        out += ["--tp-size", str(f.tp)]
    if f.pp > 1:
        out += ["--pp-size", str(f.pp)]
    frac = math.floor((f.weights_per_gpu_bytes + f.kv_pool_per_gpu_bytes) / f.gpu_total_bytes * 100) / 100
    out += [
        "--context-length",
        str(f.max_model_len),
        "--max-running-requests",
        str(f.sessions),
        "--mem-fraction-static",
        f"{frac:.2f}",
        "--chunked-prefill-size",
        str(f.max_num_batched_tokens),
    ]
    if f.kv_quantized:
        name = {"fp8_e5m2": "fp8_e5m2", "fp4_e2m1": "fp4_e2m1"}.get(f.kv_dtype, "fp8_e4m3")
        out += ["--kv-cache-dtype", name]
    if f.weights_offload_per_gpu_bytes:
        out += ["--cpu-offload-gb", _up(f.weights_offload_per_gpu_bytes)]
    return out


_GGML_OK = {"q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "f16", "f32", "bf16"}


def llamacpp_flags(f: FlagFacts) -> list[str]:
    out = ["-c", str(f.max_model_len * f.sessions), "-np", str(f.sessions)]
    if f.kv_quantized:
        t = f.kv_dtype if f.kv_dtype in _GGML_OK else "q8_0"
        # A quantized V cache needs flash attention.
        out += ["-ctk", t, "-ctv", t, "-fa", "on"]
    if f.weights_offload_per_gpu_bytes and f.weights_per_gpu_bytes:
        per_layer = f.weights_per_gpu_bytes / max(1, f.num_layers)
        out += ["-ngl", str(max(0, f.num_layers - math.ceil(f.weights_offload_per_gpu_bytes / per_layer)))]
    else:
        out += ["-ngl", "999"]
    if f.kv_offload_total_bytes:
        out += ["--no-kv-offload"]  # llama.cpp has no partial KV tier: the whole cache stays in RAM
    if f.tp > 1:
        out += ["--split-mode", "row"]
    return out


def tierguard_flags(f: FlagFacts) -> list[str]:
    dtype = "auto"
    if f.kv_quantized:
        dtype = "int8" if f.kv_dtype in ("int8",) else "fp8"
    out = [
        "--max-model-len",
        str(f.max_model_len),
        "--max-num-seqs",
        str(f.sessions),
        "--max-num-batched-tokens",
        str(max(f.max_num_batched_tokens, f.sessions)),  # the engine needs room for one token per sequence
        "--kv-cache-gib",
        _down(f.kv_pool_per_gpu_bytes),
        "--kv-dtype",
        dtype,
    ]
    if f.kv_offload_total_bytes:
        out += ["--kv-host-gib", _up(f.kv_offload_total_bytes)]
    if f.kv_disk_bytes:
        out += ["--kv-disk-dir", "/var/lib/tierguard/kv", "--kv-disk-gib", _down(f.kv_disk_bytes)]
    if f.weights_offload_per_gpu_bytes:
        out += ["--weights-offload-gib", _up(f.weights_offload_per_gpu_bytes)]
    if f.weight_dtype != "auto":
        out += ["--weight-dtype", f.weight_dtype]
    return out


def all_flags(f: FlagFacts) -> dict[str, list[str]]:
    return {
        "vllm": vllm_flags(f),
        "sglang": sglang_flags(f),
        "llamacpp": llamacpp_flags(f),
        "tierguard": tierguard_flags(f),
    }


def tp_trap(f: FlagFacts) -> str | None:
    """The R3 warning, with this plan's numbers, whenever tp > 1."""
    if f.tp <= 1:
        return None
    kv = f.kv_offload_total_bytes or 8 * GIB
    w = f.weights_offload_per_gpu_bytes or 4 * GIB
    example = "" if f.kv_offload_total_bytes else " (example sizes)"
    return (
        f"TP trap{example}: vLLM --kv-offloading-size is the TOTAL across all {f.tp} TP ranks "
        f"({kv / GIB:.1f} GiB = {kv / f.tp / GIB:.2f} GiB per rank), while --cpu-offload-gb is PER GPU "
        f"({w / GIB:.1f} GiB x {f.tp} GPUs = {w * f.tp / GIB:.1f} GiB of host RAM, 1.15-1.9x that when pinned) "
        f"and LMCache's CPU size is per rank; KV heads per rank = max(1, kv_heads // {f.tp})."
    )
