"""`tierguard plan`: what exactly does not fit, and what to change first.

Values are read as text and converted here so every bad value gets one message that
names the option (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse

from tierguard.common.errors import TierguardError
from tierguard.common.units import parse_token_list, parse_tokens

_ENGINES = ["vllm", "sglang", "llamacpp", "tierguard"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="memory accounting: KV, weights, GPU and host budgets, the remedy ladder, engine flags",
        description="Count before configuring: KV bytes per layer kind, weights, the GPU memory decomposition, "
        "host RAM budgets and the remedy ladder, with flags for vLLM, SGLang, llama.cpp and tierguard.",
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model", required=True, help="config.json path, a directory holding one, or a catalogue name"
    )
    m.add_argument("--model-dir", action="append", default=[], help="extra directory of configs (repeatable)")
    h = p.add_argument_group("hardware")
    h.add_argument(
        "--gpu",
        default=None,
        help="GPU name: H100-80GB, H200-141GB, A100-40GB, A100-80GB, L40S, L4, RTX-4090, RTX-3090, ... "
        "(without --gpu / --gpu-mem-gib the plan counts what needs no GPU)",
    )
    h.add_argument("--gpu-mem-gib", default=None, help="GPU memory per GPU in GiB (instead of --gpu)")
    h.add_argument("--tp", default="1", help="tensor-parallel size")
    h.add_argument("--pp", default="1", help="pipeline-parallel size")
    h.add_argument("--host-ram-gib", default=None, help="host RAM in GiB (default: this machine's)")
    h.add_argument("--nvme-gib", default=None, help="NVMe space for a KV disk tier in GiB")
    h.add_argument(
        "--target",
        default="gpu",
        choices=["gpu", "cpu"],
        help="cpu: plan `tierguard serve --device cpu` (or with --engine vllm, vLLM's CPU backend) "
        "in this machine's RAM instead of a GPU",
    )
    e = p.add_argument_group("engine")
    e.add_argument(
        "--engine",
        default=None,
        choices=_ENGINES,
        help="engine whose accounting to mirror (default: vllm; tierguard with --target cpu)",
    )
    e.add_argument(
        "--engine-version",
        default=None,
        help="vLLM version whose memory rules to mirror, e.g. 0.6.4, 0.11.0, 0.19.0 (default: newest)",
    )
    e.add_argument(
        "--kv-dtype",
        default="auto",
        help="auto, fp16, bf16, fp8, fp8_e4m3, fp8_e5m2, int8, fp4_e2m1, "
        "fp8_ds_mla, q8_0, q4_0, q5_0, q5_1, q4_1, iq4_nl, ...",
    )
    e.add_argument(
        "--weights-dtype",
        "--dtype",
        dest="weights_dtype",
        default="auto",
        help="auto, bf16, fp16, fp8, int8, int4, mxfp4, q4_k_m, ... (vLLM's --dtype: float32, bfloat16, float16)",
    )
    e.add_argument(
        "--kv-cache-gib",
        default=None,
        help="vLLM on CPU (--engine vllm --target cpu): the KV pool, VLLM_CPU_KVCACHE_SPACE in GiB",
    )
    e.add_argument("--block-size", default=None, help="KV block size in tokens (default: the engine's; 16, vLLM on CPU 128)")
    e.add_argument(
        "--gpu-memory-utilization", default="0.9", help="fraction of TOTAL GPU memory the engine may use"
    )
    e.add_argument(
        "--max-num-batched-tokens",
        default=None,
        help="tokens per step (sizes the activation peak; default: the engine's, by version and GPU)",
    )
    e.add_argument(
        "--max-num-seqs",
        default=None,
        help="engine's sequence limit (sizes the sampler peak; default: the engine's)",
    )
    e.add_argument(
        "--max-model-len", default=None, help="engine context limit (default: longest context + output)"
    )
    e.add_argument(
        "--no-hybrid-allocator", action="store_true", help="charge sliding/chunked layers like full ones"
    )
    e.add_argument(
        "--prefix-caching", action="store_true", help="prefix caching on (extra Mamba state pages)"
    )
    e.add_argument(
        "--cuda-graph-in-budget",
        action="store_true",
        help="count CUDA-graph memory inside the budget (vLLM does from 0.21 on by itself)",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--context", default=None, help="context lengths, e.g. 2k,8k,32k,128k (default: those <= model max)"
    )
    w.add_argument("--concurrency", default="1", help="sessions at the longest context at once")
    w.add_argument("--output-len", default="0", help="output tokens added to each context")
    r = p.add_argument_group("remedy ladder")
    r.add_argument("--trim-to", default=None, help="history may be trimmed down to this many tokens")
    r.add_argument(
        "--shared-prefix", default="0", help="tokens every session shares (system prompt, documents)"
    )
    r.add_argument("--min-concurrency", default=None, help="fewest long sessions that must run at once")
    r.add_argument("--no-kv-quant", action="store_true", help="do not propose KV quantization")
    r.add_argument("--kv-offload-gib", default=None, help="limit for KV offload to host RAM (GiB, all GPUs)")
    r.add_argument(
        "--weights-offload-gib", default=None, help="limit for weight offload to host RAM (GiB, all GPUs)"
    )
    r.add_argument(
        "--offload",
        default="none",
        choices=["none", "kv", "weights", "both"],
        help="offloads you intend to use (warns when limits are missing)",
    )
    r.add_argument(
        "--pinned-cap-gib", default=None, help="cap on pinned host memory (default: half the usable RAM)"
    )
    r.add_argument(
        "--kvcheck", default=None, metavar="RESULT.json",
        help="a `tierguard kvcheck` result: marks the kv_quantization step validated or rejected",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _float(text: str | None, what: str) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise TierguardError(f"{what} must be a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise TierguardError(f"{what} must be a finite number, got {text!r}")
    return value


def _int(text: str | None, what: str) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise TierguardError(f"{what} must be a whole number, got {text!r}") from None


def _tokens(text: str | None, what: str) -> int | None:
    if text is None:
        return None
    if str(text).strip().startswith("-"):
        raise TierguardError(f"{what} must be positive, got {text!r}")
    return parse_tokens(text, what)


def inputs_from_args(args: argparse.Namespace):
    from tierguard.plan.planner import PlanInputs

    out_len = _int(args.output_len, "--output-len")
    shared = (
        _tokens(args.shared_prefix, "--shared-prefix")
        if str(args.shared_prefix).strip() not in ("0", "")
        else 0
    )
    return PlanInputs(
        model=args.model,
        model_dirs=list(args.model_dir),
        gpu=args.gpu,
        gpu_mem_gib=_float(args.gpu_mem_gib, "--gpu-mem-gib"),
        tp=_int(args.tp, "--tp"),
        pp=_int(args.pp, "--pp"),
        host_ram_gib=_float(args.host_ram_gib, "--host-ram-gib"),
        nvme_gib=_float(args.nvme_gib, "--nvme-gib"),
        engine=args.engine,
        engine_version=args.engine_version,
        target=args.target,
        kv_dtype=args.kv_dtype,
        weights_dtype=args.weights_dtype,
        block_size=_int(args.block_size, "--block-size"),
        kv_cache_gib=_float(args.kv_cache_gib, "--kv-cache-gib"),
        gpu_memory_utilization=_float(args.gpu_memory_utilization, "--gpu-memory-utilization"),
        max_num_batched_tokens=_tokens(args.max_num_batched_tokens, "--max-num-batched-tokens"),
        max_num_seqs=_int(args.max_num_seqs, "--max-num-seqs"),
        max_model_len=_tokens(args.max_model_len, "--max-model-len"),
        contexts=parse_token_list(args.context, "--context") if args.context is not None else None,
        concurrency=_int(args.concurrency, "--concurrency"),
        output_len=out_len,
        trim_to=_tokens(args.trim_to, "--trim-to"),
        shared_prefix=shared,
        min_concurrency=_int(args.min_concurrency, "--min-concurrency"),
        allow_kv_quant=not args.no_kv_quant,
        kv_offload_gib=_float(args.kv_offload_gib, "--kv-offload-gib"),
        weights_offload_gib=_float(args.weights_offload_gib, "--weights-offload-gib"),
        offload=args.offload,
        pinned_cap_gib=_float(args.pinned_cap_gib, "--pinned-cap-gib"),
        hybrid_allocator=not args.no_hybrid_allocator,
        prefix_caching=args.prefix_caching,
        cuda_graph_in_budget=args.cuda_graph_in_budget,
    )


def run(args: argparse.Namespace) -> int:
    from tierguard.plan import kvcheck_link
    from tierguard.plan.planner import make_plan
    from tierguard.plan.render import render, to_json

    inputs = inputs_from_args(args)
    result = kvcheck_link.load_result(args.kvcheck) if getattr(args, "kvcheck", None) else None
    plan = make_plan(inputs)
    if kvcheck_link.annotate(plan, args.model, result, args.kvcheck) == "rejected":
        fmt = next(s["kv_dtype"] for s in plan["ladder"] if s["step"] == kvcheck_link.STEP)
        inputs.allow_kv_quant = False  # the check failed: the ladder must not count on it
        plan = make_plan(inputs)
        kvcheck_link.mark_rejected(plan, args.model, result, args.kvcheck, fmt)
    if args.json:
        print(to_json(plan))
    else:
        render(plan)
    return 0
