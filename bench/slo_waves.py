"""The engine under `--itl-slo-ms` at high concurrency, in-process: waves on and off.

A closed loop of C streams (256-token prompts of random ids, 64 tokens out, greedy, a
finished stream replaced at once) drives `LLMEngine.step()` directly, so no HTTP, no
client and no event loop share the cores: what is left is the scheduler's choice of
steps. Run twice in one process order (waves, then `StepBudget.wave_admits` forced off,
then again each way), it shows what starting sequences in waves buys where no prefill
chunk fits beside a decode within the SLO (scheduler.py). Prints one JSON object: per
variant and repeat, output tok/s, the p50/p99 gap between a stream's tokens and that p99
over the SLO, the steps by kind (decode-only, prefill-only, mixed) with the decode batch
sizes, and `wave_starts`: steps in which two or more sequences produced their first token
together (a wave starting). A run with waves on in which no wave formed did not measure
waves, and a run that produced no tokens measured nothing: either is `"valid": false`.
The goal, judged on valid runs only: the waves runs' p99 gap within the SLO.

    python bench/slo_waves.py [--weight-dtype int8] [--slo-ms 15] [--concurrency 32] [--duration 20]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from validity import Validity  # noqa: E402

from tierguard.common.percentile import percentile  # noqa: E402
from tierguard.engine.api import SamplingParams  # noqa: E402
from tierguard.engine.factory import build_engine  # noqa: E402
from tierguard.engine.step_budget import StepBudget  # noqa: E402
from tierguard.model.gguf_quant import gguf_source  # noqa: E402
from tierguard.model.registry import resolve_model  # noqa: E402

WAVES = StepBudget.wave_admits


def run(args, waves: bool) -> dict:
    StepBudget.wave_admits = WAVES if waves else (lambda self, n: False)
    quantized = args.weight_dtype in ("int8", "int4")
    engine = build_engine(
        resolve_model(args.model), gguf_path=gguf_source(args.model) if quantized else None,
        weight_dtype=args.weight_dtype, itl_slo_ms=args.slo_ms, kv_cache_gib=args.kv_cache_gib,
        device="cpu", max_model_len=args.prompt_tokens + args.output_tokens + 16,
        max_num_seqs=max(args.concurrency, 1), num_threads=args.threads,
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size

    def add(rid: str) -> None:
        engine.add_request(rid, [rng.randrange(100, vocab - 1) for _ in range(args.prompt_tokens)], params)

    add("warm")  # one request alone: the step budget's first decode and prefill costs
    while engine.has_unfinished():
        engine.step()
    steps: list[tuple[int, int, float]] = []
    engine.add_step_listener(lambda s: steps.append((s.num_decode_seqs, s.num_prefill_tokens, s.duration_s)))
    n = 0
    for _ in range(args.concurrency):
        add(f"r{n}")
        n += 1
    last: dict[str, float] = {}
    gaps: list[float] = []
    tokens = wave_starts = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.duration:
        firsts = 0
        for out in engine.step():
            now = time.monotonic()
            if out.new_token_ids:
                tokens += len(out.new_token_ids)
                if out.request_id in last:
                    gaps.append((now - last[out.request_id]) * 1000)
                else:
                    firsts += 1
                last[out.request_id] = now
            if out.finished:
                add(f"r{n}")
                n += 1
        wave_starts += firsts >= 2
    wall = time.monotonic() - t0
    gaps.sort()
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for d, p, s in steps:
        k = kinds["mixed" if d and p else "prefill" if p else "decode"]
        k[0] += 1
        k[1] += s * 1000
    sizes = collections.Counter(d for d, p, _ in steps if d and not p)
    return {
        "waves": waves,
        "tokens": tokens,
        "output_tok_s": round(tokens / wall, 1),
        "gap_p50_ms": round(percentile(gaps, 50), 2) if gaps else None,  # type: ignore[arg-type]
        "gap_p99_ms": round(percentile(gaps, 99), 2) if gaps else None,  # type: ignore[arg-type]
        "steps": {k: {"count": v[0], "ms": round(v[1])} for k, v in kinds.items()},
        "decode_batch_sizes": dict(sorted(sizes.items())),
        "wave_starts": wave_starts,
    }


def judge(slo_ms: float, runs: list[dict]) -> dict:
    """Validity, the p99 gaps against the SLO, and the goal (see the module docstring)."""
    v = Validity()
    for i, r in enumerate(runs):
        name = f"run {i} (waves {'on' if r['waves'] else 'off'})"
        v.require(r["tokens"] > 0 and r["gap_p99_ms"] is not None, f"{name}: no tokens, no gaps: nothing measured")
        if r["waves"]:
            v.require(r["wave_starts"] > 0, f"{name}: no wave formed (sequences started one at a time)")
        r["gap_p99_over_slo"] = None if r["gap_p99_ms"] is None else round(r["gap_p99_ms"] / slo_ms, 3)
    on = [r["gap_p99_ms"] for r in runs if r["waves"] and r["gap_p99_ms"] is not None]
    return {
        **v.as_dict(),
        "waves_formed": all(r["wave_starts"] > 0 for r in runs if r["waves"]) and any(r["waves"] for r in runs),
        "gap_p99_ms_waves_worst": max(on) if on else None,
        "gap_p99_over_slo_waves_worst": round(max(on) / slo_ms, 3) if on else None,
        "goal_gap_p99_within_slo": v.goal(bool(on) and max(on) <= slo_ms),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weight-dtype", default="int8", help="auto (float32), int8 or int4")
    ap.add_argument("--slo-ms", type=float, default=15.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.slo_ms <= 0 or args.concurrency < 1 or args.duration <= 0:
        ap.error("--slo-ms, --concurrency and --duration must be positive")
    runs = [run(args, waves) for _ in range(args.repeats) for waves in (True, False)]
    on = [r["output_tok_s"] for r in runs if r["waves"]]
    off = [r["output_tok_s"] for r in runs if not r["waves"]]
    print(json.dumps({
        "bench": "slo_waves", "model": args.model, "weight_dtype": args.weight_dtype, "slo_ms": args.slo_ms,
        "concurrency": args.concurrency, "duration_s": args.duration, "runs": runs,
        "tok_s_waves_over_none": round(sum(on) / sum(off), 3) if off and sum(off) else None,
        **judge(args.slo_ms, runs),
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
