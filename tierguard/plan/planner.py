"""`make_plan`: one call from inputs to the plan dict that `tierguard plan --json` prints.

Other commands (demo, report) read this dict; its top-level keys are a contract:
model, kv, weights_bytes, weights_bytes_per_gpu, gpu, max_concurrency, fits, host,
ladder, flags (plus more fields).
"""

from __future__ import annotations

from dataclasses import replace

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.plan.catalogue import load_model
from tierguard.plan.config import ModelSpec
from tierguard.plan.dtypes import kv_format, weight_format
from tierguard.plan.flags import FlagFacts, all_flags, tp_trap
from tierguard.plan.gpu import decompose, find_gpu
from tierguard.plan.host import host_budget, settle
from tierguard.plan.inputs import PlanInputs, validate
from tierguard.plan.kv import GROWING, KVModel, KVSettings
from tierguard.plan.ladder import LadderState, Workload, run_ladder
from tierguard.plan.weights import estimate_weights

__all__ = ["PlanInputs", "make_plan"]


def _quant_target(engine: str) -> str:
    """The 8-bit KV format each engine offers first."""
    return "q8_0" if engine == "llamacpp" else "fp8"


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def _gib(v: float | None) -> int | None:
    return None if v is None else int(v * GIB)


def make_plan(p: PlanInputs) -> dict:
    """Compute the whole plan; raises TierguardError on bad input."""
    spec = p.model if isinstance(p.model, ModelSpec) else load_model(p.model, p.model_dirs)
    contexts, mml = validate(p, spec)
    gpu = find_gpu(p.gpu, p.gpu_mem_gib)
    # llama.cpp's default cache type is f16 whatever the checkpoint dtype.
    auto_llamacpp = p.engine == "llamacpp" and p.kv_dtype.strip().lower() == "auto"
    fmt = kv_format("f16" if auto_llamacpp else p.kv_dtype, spec.torch_dtype)
    if fmt.name == "fp8_ds_mla" and spec.mla is None:
        raise TierguardError("--kv-dtype fp8_ds_mla applies only to MLA models (DeepSeek-V2/V3)")
    settings = KVSettings(
        fmt=fmt,
        max_model_len=mml,
        tp=p.tp,
        pp=p.pp,
        block_size=p.block_size,
        max_num_batched_tokens=p.max_num_batched_tokens,
        hybrid_allocator=p.hybrid_allocator,
        prefix_caching=p.prefix_caching,
    )
    kvm = KVModel(spec, settings)
    wfmt = weight_format(p.weights_dtype, spec.torch_dtype, spec.quantization)
    w = estimate_weights(spec, wfmt, p.tp, p.pp)
    dec = decompose(
        gpu,
        spec,
        w.per_gpu_bytes,
        tp=p.tp,
        pp=p.pp,
        gmu=p.gpu_memory_utilization,
        batched_tokens=p.max_num_batched_tokens,
        max_num_seqs=p.max_num_seqs,
        engine=p.engine,
        cuda_graph_in_budget=p.cuda_graph_in_budget,
    )
    avail = dec.kv_available_bytes_per_gpu
    seq_mml = kvm.sequence_bytes_per_gpu(mml)
    capacity = int(avail / seq_mml * mml) if seq_mml else 0
    page = p.block_size * kvm.bytes_per_token_per_gpu()
    gpus = p.tp * p.pp

    longest = max(contexts) + p.output_len
    quant = None
    if p.allow_kv_quant and not fmt.quantized:
        quant = KVModel(spec, replace(settings, fmt=kv_format(_quant_target(p.engine))))
    state = LadderState(
        kvm=kvm,
        vram=avail - dec.shortfall_bytes,
        context=longest,
        sessions=p.concurrency,
        total_sessions=p.concurrency,
        gpus=gpus,
    )
    fits = state.fits()
    host = host_budget(
        _gib(p.host_ram_gib),
        kv_limit=_gib(p.kv_offload_gib),
        weights_limit=_gib(p.weights_offload_gib),
        offload=p.offload,
        pinned_cap=_gib(p.pinned_cap_gib),
        nvme_bytes=_gib(p.nvme_gib),
    )
    wl = Workload(
        context=longest,
        concurrency=p.concurrency,
        trim_to=p.trim_to,
        shared_prefix=p.shared_prefix,
        min_concurrency=p.min_concurrency,
    )
    steps = run_ladder(
        state, wl, quant, host.kv_offload_budget_bytes, host.weights_offload_budget_bytes, w.per_gpu_bytes
    )
    settle(host, state.kv_ram_total, state.weights_off_per_gpu * gpus)

    final_fmt = state.kvm.s.fmt
    facts = FlagFacts(
        engine=p.engine,
        tp=p.tp,
        pp=p.pp,
        num_layers=spec.num_layers,
        gmu=p.gpu_memory_utilization,
        max_model_len=state.context if (p.max_model_len is None or state.context < longest) else mml,
        context=state.context,
        sessions=state.sessions,
        max_num_batched_tokens=p.max_num_batched_tokens,
        block_size=p.block_size,
        kv_dtype=final_fmt.name,
        kv_quantized=final_fmt.quantized,
        prefix_caching=p.prefix_caching or state.prefix > 0,
        kv_offload_total_bytes=state.kv_ram_total,
        weights_offload_per_gpu_bytes=state.weights_off_per_gpu,
        weights_per_gpu_bytes=w.per_gpu_bytes - state.weights_off_per_gpu,
        kv_pool_per_gpu_bytes=max(0, state.vram_total()),
        gpu_total_bytes=gpu.total_bytes,
        kv_disk_bytes=host.kv_disk_budget_bytes,
    )
    warnings = list(host.warnings)
    if dec.shortfall_bytes:
        warnings.append(
            f"weights and overheads exceed the GPU budget by {dec.shortfall_bytes / GIB:.2f} GiB per GPU"
        )
    if (
        not dec.cuda_graph_in_budget
        and p.engine in ("vllm", "sglang")
        and dec.headroom_bytes < dec.cuda_graph_bytes
    ):
        warnings.append(
            f"CUDA graphs (~{dec.cuda_graph_bytes / GIB:.2f} GiB) are captured after the KV pool is sized "
            f"and may not fit the {dec.headroom_bytes / GIB:.2f} GiB left outside the budget"
        )
    if spec.mla is None and p.tp > spec.num_kv_heads:
        warnings.append(
            f"tp {p.tp} > {spec.num_kv_heads} KV heads: each rank keeps a whole head, the cluster holds "
            f"{kvm.replication:g} copies of the KV"
        )

    kinds = {k: spec.count(k) for k in dict.fromkeys(spec.layer_kinds)}
    return {
        "model": {
            "name": spec.name,
            "architecture": spec.architecture,
            "num_layers": spec.num_layers,
            "layer_kinds": kinds,
            "num_attention_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "hidden_size": spec.hidden_size,
            "vocab_size": spec.vocab_size,
            "max_position_embeddings": spec.max_position_embeddings,
            "sliding_window": spec.sliding_window,
            "attention_chunk_size": spec.chunk_size,
            "mla_latent": (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) if spec.mla else None,
            "params": w.params,
            "params_b_published": spec.params_b,
            "torch_dtype": spec.torch_dtype,
        },
        "engine": p.engine,
        "settings": {
            "tp": p.tp,
            "pp": p.pp,
            "block_size": p.block_size,
            "gpu_memory_utilization": p.gpu_memory_utilization,
            "max_num_batched_tokens": p.max_num_batched_tokens,
            "max_num_seqs": p.max_num_seqs,
            "max_model_len": mml,
            "hybrid_allocator": p.hybrid_allocator,
        },
        "workload": {
            "contexts": contexts,
            "concurrency": p.concurrency,
            "output_len": p.output_len,
            "longest_sequence": longest,
            "trim_to": p.trim_to,
            "shared_prefix": p.shared_prefix,
            "min_concurrency": p.min_concurrency,
            "kv_bytes": p.concurrency * kvm.sequence_bytes(longest),
            "kv_bytes_per_gpu": p.concurrency * kvm.sequence_bytes_per_gpu(longest),
        },
        "kv": {
            "dtype": fmt.name,
            "format_note": fmt.note,
            "bytes_per_token": kvm.bytes_per_token(),
            "bytes_per_token_per_gpu": kvm.bytes_per_token_per_gpu(),
            "per_sequence_bytes": {str(c): kvm.sequence_bytes(c) for c in contexts},
            "per_sequence_bytes_per_gpu": {str(c): kvm.sequence_bytes_per_gpu(c) for c in contexts},
            "kv_heads_per_rank": kvm.kv_heads_per_rank if spec.mla is None else 1,
            "replication": kvm.replication,
            "growing_layers": sum(1 for k in spec.layer_kinds if k in GROWING),
            "constant_state_bytes_per_sequence": sum(
                kvm.state_bytes(k, per_rank=False) for k in spec.layer_kinds
            ),
        },
        "weights_dtype": wfmt.name,
        "weights_bytes": w.total_bytes,
        "weights_bytes_per_gpu": w.per_gpu_bytes,
        "gpu": {
            **dec.as_dict(),
            "kv_capacity_tokens": capacity,
            "num_blocks": (avail // page) if page else 0,
            "gpus": gpus,
        },
        "max_concurrency": {str(c): _ratio(avail, kvm.sequence_bytes_per_gpu(c)) for c in contexts},
        "fits": fits,
        "fits_after_ladder": state.fits(),
        "host": host.as_dict(),
        "ladder": [s.as_dict() for s in steps],
        "final": {
            "context": state.context,
            "sessions": state.sessions,
            "kv_dtype": final_fmt.name,
            "prefix_caching": state.prefix > 0,
            "kv_offload_bytes_total": state.kv_ram_total,
            "weights_offload_bytes_per_gpu": state.weights_off_per_gpu,
        },
        "flags": all_flags(facts),
        "tp_trap": tp_trap(facts),
        "warnings": warnings,
    }
