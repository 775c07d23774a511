"""Decode-speed probe: `python -m tierguard.engine.speed [--batch 1,32] [--threads N]`.

Prints one JSON line per batch size: output tokens/s of steady-state decode (prefill
excluded) on the default tiny model, or `--model DIR`. Timings on a shared machine are
noisy; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tierguard.engine.api import SamplingParams
from tierguard.engine.factory import build_engine
from tierguard.model.tiny import ensure_tiny_model


def measure(engine, batch: int, prompt_len: int, steps: int, temperature: float) -> dict:
    prompt = [(7 * i) % (engine.model_config.vocab_size - 10) + 5 for i in range(prompt_len)]
    for i in range(batch):
        engine.add_request(
            f"speed-{batch}-{i}",
            prompt,
            SamplingParams(max_tokens=steps + 8, temperature=temperature, seed=i, ignore_eos=True),
        )
    while any(s.is_prefill for s in engine.seqs.values()):
        engine.step()
    engine.step()
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    for rid in list(engine.seqs):
        engine.abort(rid)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "steps": steps,
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
        "ms_per_step": round(elapsed / steps * 1000, 2),
        "threads": torch.get_num_threads(),
        "temperature": temperature,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = build_engine(args.model or ensure_tiny_model(), kv_cache_gib=0.25, device="auto")
    for b in [int(x) for x in args.batch.split(",")]:
        print(
            json.dumps(
                {
                    "model": engine.model_name,
                    **measure(engine, b, args.prompt_len, args.steps, args.temperature),
                }
            )
        )
    engine.check_integrity()


if __name__ == "__main__":
    main()
