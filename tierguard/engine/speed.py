"""Decode-speed probe: `python -m tierguard.engine.speed [--batch 1,32] [--threads N]`.

Prints one JSON line per batch size: output tokens/s of steady-state decode (prefill
excluded) on the default tiny model, or `--model smollm2|DIR|FILE.gguf`, then (unless
`--no-profile`) a
one-line summary of where a step's time goes (tierguard/engine/profile.py, measured
with torch.profiler over further steps, so its absolute times include the profiler's
own overhead; the JSON's `ms_per_step` does not). Timings on a shared machine are
noisy; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from tierguard.engine.api import SamplingParams
from tierguard.engine.factory import build_engine
from tierguard.engine.profile import profile_steps, summary_line
from tierguard.model.gguf_quant import gguf_source
from tierguard.model.registry import resolve_model


def measure(
    engine, batch: int, prompt_len: int, steps: int, temperature: float, profile: int = 0
) -> dict:
    prompt = [(7 * i) % (engine.model_config.vocab_size - 10) + 5 for i in range(prompt_len)]
    # the first sequences decode while the later ones prefill: their tokens must last
    prefill_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
    for i in range(batch):
        engine.add_request(
            f"speed-{batch}-{i}",
            [(t + i) % (engine.model_config.vocab_size - 10) + 5 for t in prompt],  # distinct: no prefix hits
            SamplingParams(
                max_tokens=steps + profile + prefill_steps + 8, temperature=temperature, seed=i, ignore_eos=True
            ),
        )
    while any(s.is_prefill for s in engine.seqs.values()):
        engine.step()
    running = len(engine.scheduler.running)
    if running < batch:
        print(f"speed probe: only {running} of {batch} sequences fit the KV pool; raise --kv-cache-gib", file=sys.stderr)
        sys.exit(2)
    engine.step()
    start, cpu_start, tokens = time.perf_counter(), time.process_time(), 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    parts = profile_steps(engine, profile) if profile else None
    for rid in list(engine.seqs):
        engine.abort(rid)
    out = {
        "batch": batch,
        "prompt_len": prompt_len,
        "steps": steps,
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
        "ms_per_step": round(elapsed / steps * 1000, 2),
        # CPU time of all threads per step: on a shared machine, wall time also counts
        # the time other processes held the cores; with one thread this is the step's work.
        "cpu_ms_per_step": round(cpu / steps * 1000, 2),
        "threads": torch.get_num_threads(),
        "temperature": temperature,
        "weight_dtype": engine.runner.weight_dtype,
        "weight_bytes": engine.runner.weight_bytes,
    }
    if parts is not None:
        out["profile_ms_per_step"] = parts
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, smollm2, a model directory or a .gguf file")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--weight-dtype", default="auto", help="auto, bf16, int8 or int4 (weight-only quantization)")
    ap.add_argument("--kv-cache-gib", type=float, default=0.25)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--profile-steps", type=int, default=16, help="steps under torch.profiler (0: none)")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    batches = [int(x) for x in args.batch.split(",")]
    max_len = args.max_model_len or args.prompt_len + args.steps + args.profile_steps + 16
    engine = build_engine(
        resolve_model(args.model),
        gguf_path=gguf_source(args.model) if args.weight_dtype in ("int8", "int4") else None,
        kv_cache_gib=args.kv_cache_gib,
        device="auto",
        num_threads=args.threads,
        weight_dtype=args.weight_dtype,
        max_model_len=max_len,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(512, max(batches)),
        # steady-state decode of the whole batch: no step budget, which would keep later
        # prefills queued while the first sequences decode (a "batch 32" ran ~4 sequences)
        target_itl_ms=0.0,
    )
    profile = 0 if args.no_profile else args.profile_steps
    for b in batches:
        result = measure(engine, b, args.prompt_len, args.steps, args.temperature, profile)
        print(json.dumps({"model": engine.model_name, **result}), flush=True)
        if profile:
            print(f"profile batch {b}: {summary_line(result['profile_ms_per_step'])}", file=sys.stderr)
    engine.check_integrity()


if __name__ == "__main__":
    main()
