"""`make_plan`: one call from inputs to the plan dict that `tierguard plan --json` prints.

Other commands (demo, report) read this dict; its top-level keys are a contract:
model, kv, weights_bytes, weights_bytes_per_gpu, gpu, max_concurrency, fits, host,
ladder, flags (plus more fields). Without --gpu / --gpu-mem-gib (and without
--target cpu) the plan counts what needs no GPU and `gpu` is None.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.plan.catalogue import load_model
from tierguard.plan.config import ModelSpec
from tierguard.plan.cpu import (
    CPU_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    SERVE_WEIGHTS,
    cpu_weight_format,
    ram_decompose,
)
from tierguard.plan.dtypes import kv_format, weight_format
from tierguard.plan.fit import activation_bytes, fitted
from tierguard.plan.flags import FlagFacts, all_flags, tierguard_flags, tp_trap
from tierguard.plan.gpu import GPU, decompose, find_gpu
from tierguard.plan.host import host_budget, settle
from tierguard.plan.inputs import PlanInputs, validate
from tierguard.plan.kv import KVModel, KVSettings
from tierguard.plan.ladder import LadderState, Workload, run_ladder
from tierguard.plan.reserves import EngineRules, default_batching, engine_rules
from tierguard.plan.summary import kv_dict, model_dict, settings_dict, weights_by_dtype
from tierguard.plan.vllm_cpu import cpu_holds_fp8_kv, serving_dtype, vllm_cpu_figures
from tierguard.plan.weights import estimate_weights

__all__ = ["PlanInputs", "make_plan"]

GPU_NEEDED = "GPU capacity needs --gpu NAME or --gpu-mem-gib GIB (or --target cpu for this machine's RAM)"


def _quant_target(engine: str) -> str:
    """The 8-bit KV format each engine offers first."""
    return "q8_0" if engine == "llamacpp" else "fp8"


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def _gib(v: float | None) -> int | None:
    return None if v is None else int(v * GIB)


def _kv_dtype(p: PlanInputs, spec: ModelSpec) -> str:
    """`auto` follows the model dtype; an explicit float --weights-dtype (vLLM --dtype) wins,
    and llama.cpp's default cache type is f16 whatever the checkpoint dtype."""
    if p.kv_dtype.strip().lower() != "auto":
        return p.kv_dtype
    if p.engine == "llamacpp":
        return "f16"
    w = _weights_dtype(p, spec).strip().lower()
    return w if w in ("fp32", "float32", "fp16", "float16", "bf16", "bfloat16") else "auto"


def _weights_dtype(p: PlanInputs, spec: ModelSpec) -> str:
    """tierguard serve's `--dtype auto` keeps a float checkpoint's own dtype (float32 runs
    in float32, its KV too), where vLLM's `auto` runs float32 checkpoints in bf16."""
    if p.engine == "tierguard" and p.weights_dtype.strip().lower() == "auto" and not spec.quantization:
        return str(spec.torch_dtype)
    return p.weights_dtype


def _batching(p: PlanInputs, rules: EngineRules | None, gpu: GPU | None, mml: int) -> tuple[int, int, str]:
    """max_num_batched_tokens / max_num_seqs: given, or the engine's default."""
    if p.target == "cpu":
        mnbt, mns, why = CPU_BATCHED_TOKENS, CPU_MAX_NUM_SEQS, "tierguard serve defaults on CPU"
    elif rules is not None and gpu is not None:
        mnbt, mns, why = default_batching(rules, gpu.name, gpu.total_bytes, mml)
    else:
        mnbt, mns, why = 8192, 256, "planner default"
    if p.max_num_batched_tokens is not None or p.max_num_seqs is not None:
        why = "given" if p.max_num_batched_tokens and p.max_num_seqs else f"partly given; rest: {why}"
    return p.max_num_batched_tokens or mnbt, p.max_num_seqs or mns, why


def _pool(state: LadderState, cpu: bool) -> int:
    """KV pool to ask the engine for. On CPU: what the workload needs (rounded up to the
    0.01 GiB the flag prints), not all free RAM, which the OS and page cache share (R6)."""
    room = max(0, state.vram_total())
    if not cpu:
        return room
    return min(room, state.need() + GIB // 100)


def make_plan(p: PlanInputs) -> dict:
    """Compute the whole plan; raises TierguardError on bad input."""
    if p.engine is None:
        p = replace(p, engine="tierguard" if p.target == "cpu" else "vllm")
    spec = p.model if isinstance(p.model, ModelSpec) else load_model(p.model, p.model_dirs)
    if p.engine == "vllm" and p.target == "cpu":
        return vllm_cpu_plan(p, spec)
    if p.block_size is None:
        p = replace(p, block_size=16)
    contexts, mml = validate(p, spec)
    rules = engine_rules(p.engine_version) if p.engine == "vllm" else None
    fmt = kv_format(_kv_dtype(p, spec), spec.torch_dtype)
    if fmt.name == "fp8_ds_mla" and spec.mla is None:
        raise TierguardError("--kv-dtype fp8_ds_mla applies only to MLA models (DeepSeek-V2/V3)")
    wfmt = weight_format(_weights_dtype(p, spec), spec.torch_dtype, spec.quantization)
    cpu = p.target == "cpu"
    if cpu:
        wfmt = cpu_weight_format(wfmt)  # tierguard serve's own int8/int4 bytes
    w = estimate_weights(spec, wfmt, p.tp, p.pp)
    counting = not cpu and p.gpu is None and p.gpu_mem_gib is None
    gpu = None if cpu or counting else find_gpu(p.gpu, p.gpu_mem_gib)
    mnbt, mns, batching_why = _batching(p, rules, gpu, mml)
    hybrid = p.hybrid_allocator and (rules is None or rules.v1)
    settings = KVSettings(
        fmt=fmt,
        max_model_len=mml,
        tp=p.tp,
        pp=p.pp,
        block_size=p.block_size,
        max_num_batched_tokens=mnbt,
        hybrid_allocator=hybrid,
        prefix_caching=p.prefix_caching,
    )
    kvm = KVModel(spec, settings)
    longest = max(contexts) + p.output_len
    host = host_budget(
        _gib(p.host_ram_gib),
        kv_limit=_gib(p.kv_offload_gib),
        weights_limit=_gib(p.weights_offload_gib),
        offload=p.offload,
        pinned_cap=_gib(p.pinned_cap_gib),
        nvme_bytes=_gib(p.nvme_gib),
    )
    common = {
        "model": model_dict(spec, w.params),
        "engine": p.engine,
        "engine_rules": None,
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
        "kv": kv_dict(kvm, contexts, spec),
        "weights_dtype": wfmt.name,
        "weights_bytes": w.total_bytes,
        "weights_bytes_per_gpu": w.per_gpu_bytes,
        "weights_by_dtype": weights_by_dtype(p, spec, wfmt.name),
    }
    if counting:
        settle(host, 0, 0)
        return {
            **common,
            "settings": settings_dict(p, mml, p.max_num_batched_tokens, p.max_num_seqs, hybrid),
            "gpu": None,
            "max_concurrency": {},
            "fits": None,
            "fits_after_ladder": None,
            "host": host.as_dict(),
            "ladder": [],
            "final": None,
            "flags": {},
            "tp_trap": None,
            "warnings": list(host.warnings),
            "gpu_needed": GPU_NEEDED,
        }

    reserves = None
    if rules is not None:
        reserves = p.reserve_fit or fitted(rules.band.name)
        common["engine_rules"] = {
            "version": rules.version,
            "band": rules.band.name,
            "engine": rules.band.engine,
            "note": rules.band.note,
            "batching": batching_why,
            "reserves": {k: v for k, v in asdict(reserves).items() if k != "band"},
        }
    # tierguard serve computes in float32 around its int8/int4 matmuls
    act_bytes = 4 if cpu and wfmt.name in SERVE_WEIGHTS else activation_bytes(wfmt.name)
    if cpu:
        dec = ram_decompose(host, spec, w.per_gpu_bytes, mnbt, mns, act_bytes)
    else:
        dec = decompose(
            gpu,
            spec,
            w.per_gpu_bytes,
            tp=p.tp,
            pp=p.pp,
            gmu=p.gpu_memory_utilization,
            batched_tokens=mnbt,
            max_num_seqs=mns,
            engine=p.engine,
            cuda_graph_in_budget=p.cuda_graph_in_budget
            or (rules is not None and rules.band.graphs_in_budget),
            reserves=reserves,
            act_bytes=act_bytes,
        )
    avail = dec.kv_available_bytes_per_gpu
    page = p.block_size * kvm.bytes_per_token_all_layers_per_gpu()
    gpus = p.tp * p.pp

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
    wl = Workload(
        context=longest,
        concurrency=p.concurrency,
        trim_to=p.trim_to,
        shared_prefix=p.shared_prefix,
        min_concurrency=p.min_concurrency,
    )
    # On --target cpu the KV pool already is host RAM: no RAM offload tier below it.
    kv_off = 0 if cpu else host.kv_offload_budget_bytes
    w_off = 0 if cpu else host.weights_offload_budget_bytes
    steps = run_ladder(state, wl, quant, kv_off, w_off, w.per_gpu_bytes)
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
        max_num_batched_tokens=mnbt,
        block_size=p.block_size,
        kv_dtype=final_fmt.name,
        kv_quantized=final_fmt.quantized,
        prefix_caching=p.prefix_caching or state.prefix > 0,
        kv_offload_total_bytes=state.kv_ram_total,
        weights_offload_per_gpu_bytes=state.weights_off_per_gpu,
        weights_per_gpu_bytes=w.per_gpu_bytes - state.weights_off_per_gpu,
        # On CPU the pool takes what the workload needs, not all free RAM (R6: RAM is shared).
        kv_pool_per_gpu_bytes=_pool(state, cpu),
        gpu_total_bytes=dec.total_bytes,
        kv_disk_bytes=host.kv_disk_budget_bytes,
        weight_dtype=wfmt.name if cpu and wfmt.name in SERVE_WEIGHTS else "auto",
    )
    warnings = list(host.warnings)
    if p.engine_version is not None and rules is None:
        warnings.append(f"--engine-version applies to vllm's rules; {p.engine} ignores it")
    if dec.shortfall_bytes:
        where = "usable host RAM" if cpu else "GPU budget"
        per = "" if cpu else " per GPU"
        warnings.append(
            f"weights and overheads exceed the {where} by {dec.shortfall_bytes / GIB:.2f} GiB{per}"
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
    flags = {"tierguard": ["--device", "cpu", *tierguard_flags(facts)]} if cpu else all_flags(facts)
    return {
        **common,
        "settings": settings_dict(p, mml, mnbt, mns, hybrid),
        "gpu": {
            **dec.as_dict(),
            "kv_capacity_tokens": (avail // page) * p.block_size if page else 0,
            "num_blocks": (avail // page) if page else 0,
            "page_bytes": page,
            "gpus": gpus,
            "total_source": gpu.source if gpu is not None else "host RAM",
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
        "flags": flags,
        "tp_trap": None if cpu else tp_trap(facts),
        "warnings": warnings,
    }


def vllm_cpu_plan(p: PlanInputs, spec: ModelSpec) -> dict:
    """`--engine vllm --target cpu`: the pool is what the user asks for (--kv-cache-gib), so the
    plan is vLLM's own arithmetic (plan/vllm_cpu.py), no memory decomposition or ladder."""
    block_size = p.block_size  # None: vLLM's CPU default
    p = replace(p, block_size=block_size or 16, max_model_len=p.max_model_len or spec.max_position_embeddings)
    contexts, mml = validate(p, spec)
    model_path = p.model if isinstance(p.model, str) else spec.name
    fig = vllm_cpu_figures(
        spec,
        kv_cache_gib=p.kv_cache_gib,
        dtype=p.weights_dtype,
        kv_dtype=p.kv_dtype,
        block_size=block_size,
        max_model_len=mml,
        model_path=model_path,
    )
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[serving_dtype(p.weights_dtype, spec.torch_dtype)]
    kv_name = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(fig["kv_cache_dtype"], "fp8")
    settings = KVSettings(fmt=kv_format(kv_name), max_model_len=mml, block_size=fig["block_size"])
    kvm = KVModel(spec, settings)
    w = estimate_weights(spec, weight_format(dtype, spec.torch_dtype, spec.quantization), 1, 1)
    longest = max(contexts) + p.output_len
    per_request = -(-longest // fig["block_size"])
    usable_blocks = max(0, fig["num_blocks"] - 1)  # the null block is never handed out
    fits = fig["starts"] and p.concurrency * per_request <= usable_blocks
    warnings = []
    if not fig["starts"]:
        warnings.append(
            f"vLLM will refuse to start: one request at --max-model-len {mml} needs "
            f"{fig['blocks_per_request'] * fig['block_bytes'] / GIB:.2f} GiB of KV; the pool holds "
            f"--max-model-len {fig['longest_max_model_len']} at most"
        )
    if fig["kv_cache_dtype"].startswith("fp8") and not cpu_holds_fp8_kv():
        warnings.append(
            f"--kv-dtype {fig['kv_cache_dtype']}: vLLM's CPU attention keeps an fp8 KV cache only on x86 "
            "with AVX-512 or AMX, and the CPU this plan ran on has neither: there vLLM refuses to start"
        )
    return {
        "model": model_dict(spec, w.params),
        "engine": "vllm",
        "engine_rules": None,
        "workload": {
            "contexts": contexts,
            "concurrency": p.concurrency,
            "output_len": p.output_len,
            "longest_sequence": longest,
            "kv_bytes": p.concurrency * per_request * fig["block_bytes"],
            "kv_bytes_per_gpu": p.concurrency * per_request * fig["block_bytes"],
        },
        "kv": kv_dict(kvm, contexts, spec),
        "weights_dtype": dtype,
        "weights_bytes": w.total_bytes,
        "weights_bytes_per_gpu": w.per_gpu_bytes,
        "weights_by_dtype": weights_by_dtype(p, spec, dtype),
        "settings": {**settings_dict(p, mml, None, None, False), "block_size": fig["block_size"]},
        "gpu": None,
        "vllm_cpu": fig,
        "max_concurrency": {str(mml): fig["max_concurrency"]},
        "fits": fits,
        "fits_after_ladder": fits,
        "host": None,
        "ladder": [],
        "final": None,
        "env": fig["env"],
        "flags": {"vllm": fig["flags"]},
        "tp_trap": None,
        "warnings": warnings,
    }
