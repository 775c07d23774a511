"""Decode and prefill speed of each weight kind, as ratios to float32 measured in one process.

One engine per weight kind (float32 `auto`, `bf16`, `int8`) on one model (default
SmolLM2-135M-Instruct). Each round measures every kind in turn (the order rotates per
round, so a neighbour's load falls on all of them): steady-state decode tok/s at each
`--batch` (tierguard.engine.speed.measure), and the prefill tok/s of one step that
carries a `--chunk`-token prompt, through the fused step and through the per-op path
(torch's matmuls). Reported: the median over rounds per kind, and each
kind's ratio to float32 per round and its median. Absolute figures depend on the machine
and what else runs on it; the ratios are the result. Also in the JSON: the instruction
sets the kernels were built with and the peak multiply-add rates of the same process
(kernels/isa.c), and each kind's achieved FLOP/s as a fraction of its peak.

Valid when every kind held its own weights (bf16 half the float32 bytes, int8 under a
third), the fused step ran for every kind, and every batch ran at its size.

    .venv/bin/python bench/weight_dtype_speed.py [--model smollm2] [--rounds 3] [--batch 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from validity import Validity  # noqa: E402

from tierguard.engine.api import SamplingParams  # noqa: E402
from tierguard.engine.factory import build_engine  # noqa: E402
from tierguard.engine.speed import measure  # noqa: E402
from tierguard.model import fused_decode, native  # noqa: E402
from tierguard.model.gguf_quant import gguf_source  # noqa: E402
from tierguard.model.registry import resolve_model  # noqa: E402

KINDS = ("auto", "bf16", "int8")
PEAK_OF = {"auto": "float32_fma", "bf16": "bfloat16_dot", "int8": "float32_fma"}  # int8 widens to float32


def prefill_rate(engine, chunk: int, tag: str, fused: bool = True) -> float:
    """Tokens/s of one step that prefills a fresh `chunk`-token prompt (nothing cached);
    `fused=False`: through the per-op path (torch's matmuls), as a step over the fused
    step's row limit would run."""
    vocab = engine.model_config.vocab_size - 10
    ids = [(13 * i + zlib.crc32(tag.encode())) % vocab + 5 for i in range(chunk)]
    engine.add_request(tag, ids, SamplingParams(max_tokens=1, temperature=0.0))
    limit = fused_decode.MAX_BATCH
    fused_decode.MAX_BATCH = limit if fused else 0
    try:
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
    finally:
        fused_decode.MAX_BATCH = limit
    while engine.has_unfinished():
        engine.step()
    return chunk / elapsed


def flops_per_token(engine) -> float:
    """2 x the linear weights' multiply-adds per token (attention's own work left out)."""
    n = 0
    for mod in engine.runner.model.modules():
        if hasattr(mod, "in_features") and hasattr(mod, "out_features") and not list(mod.children()):
            n += mod.in_features * mod.out_features
    return 2.0 * n


def judge(report: dict, v: Validity | None = None) -> dict:
    v = v or Validity()
    kinds = report.get("kinds", {})
    v.require(set(kinds) == set(KINDS), f"kinds measured: {sorted(kinds)}")
    for kind, limit in (("bf16", 0.51), ("int8", 0.34)):
        if kind in kinds:
            v.require(kinds[kind]["bytes_vs_float32"] <= limit,
                      f"{kind}: {kinds[kind]['bytes_vs_float32']} of the float32 bytes: not {kind} weights")
    for kind, k in kinds.items():
        v.require(k.get("fused_steps", 0) > 0, f"{kind}: the fused step never ran")
        v.require(k.get("short_batches", 0) == 0, f"{kind}: some batch ran below its size")
    report.update(v.as_dict())
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--threads", type=int, default=None, help="torch's (and the kernels') threads")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    kinds = args.kinds.split(",")
    model_dir = resolve_model(args.model)
    engines = {}
    for kind in kinds:
        engines[kind] = build_engine(
            model_dir,
            gguf_path=gguf_source(args.model) if kind in ("int8", "int4") else None,
            kv_cache_gib=0.25,
            weight_dtype=kind,
            num_threads=args.threads,
            max_model_len=max(args.chunk, args.prompt_len + args.steps + 64) + 16,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(512, args.chunk, max(batches)),
            target_itl_ms=0.0,
        )
    decode: dict = {k: {b: [] for b in batches} for k in kinds}
    prefill: dict = {k: [] for k in kinds}
    per_op: dict = {k: [] for k in kinds}
    short = {k: 0 for k in kinds}
    for kind in kinds:  # warm-up, not counted: first-touch of the weights, the KV pool, buffers
        measure(engines[kind], max(batches), args.prompt_len, 4, 0.0)
        prefill_rate(engines[kind], args.chunk, f"warm-{kind}")
    for r in range(args.rounds):
        order = kinds[r % len(kinds):] + kinds[: r % len(kinds)]
        for kind in order:
            engine = engines[kind]
            for b in batches:
                res = measure(engine, b, args.prompt_len, args.steps, 0.0)
                decode[kind][b].append(res["tokens_per_s"])
                short[kind] += res["tokens"] < b * args.steps
            prefill[kind].append(prefill_rate(engine, args.chunk, f"prefill-{kind}-{r}"))
            per_op[kind].append(prefill_rate(engine, args.chunk, f"per-op-{kind}-{r}", fused=False))
        print(f"round {r}: " + json.dumps({k: {b: decode[k][b][-1] for b in batches} for k in kinds}),
              file=sys.stderr, flush=True)
    peaks = {name: native.peak_ops(name) for name in native.PEAK_KINDS}
    base = "auto" if "auto" in kinds else kinds[0]
    report: dict = {
        "bench": "weight_dtype_speed",
        "model": engines[base].model_name,
        "threads": torch.get_num_threads(),
        "isa": native.isa(),
        "peak_ops_per_s": {k: (round(v / 1e9, 1) if v else None) for k, v in peaks.items()},
        "rounds": args.rounds,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "chunk": args.chunk,
        "kinds": {},
    }
    for kind in kinds:
        eng = engines[kind]
        fpt = flops_per_token(eng)
        peak = peaks.get(PEAK_OF.get(kind, "float32_fma"))
        med_decode = {b: round(statistics.median(decode[kind][b]), 1) for b in batches}
        med_prefill = round(statistics.median(prefill[kind]), 1)
        decoder = eng.runner.model._fused
        entry = {
            "weight_bytes": eng.runner.weight_bytes,
            "bytes_vs_float32": round(eng.runner.weight_bytes / engines[base].runner.weight_bytes, 4),
            "decode_tok_s": med_decode,
            "prefill_tok_s": med_prefill,
            "prefill_per_op_tok_s": round(statistics.median(per_op[kind]), 1),
            "prefill_fused_vs_per_op": round(
                statistics.median(x / y for x, y in zip(prefill[kind], per_op[kind], strict=True)), 3
            ),
            "fused_steps": decoder.steps if isinstance(decoder, fused_decode.FusedDecoder) else 0,
            "short_batches": short[kind],
            "gflop_per_token": round(fpt / 1e9, 4),
            "peak_fraction": {
                **{f"decode_b{b}": round(med_decode[b] * fpt / peak, 4) for b in batches},
                "prefill": round(med_prefill * fpt / peak, 4),
            } if peak else None,
        }
        if kind != base:
            entry["decode_vs_float32"] = {
                b: round(statistics.median(x / y for x, y in zip(decode[kind][b], decode[base][b], strict=True)), 3)
                for b in batches
            }
            entry["prefill_vs_float32"] = round(
                statistics.median(x / y for x, y in zip(prefill[kind], prefill[base], strict=True)), 3
            )
        report["kinds"][kind] = entry
    judge(report)
    for eng in engines.values():
        eng.check_integrity()
        eng.close()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
