"""What weight offload costs per token: TPOT with 0, half and all decoder layers offloaded.

Weight offload (R1) is paid on every forward pass, unlike KV offload. This runs the same
decode workload (fixed prompts, greedy, ignore_eos, fixed output length) on one engine
per setting, interleaving the settings over several rounds so drift on a shared machine
hits all of them alike, and reports TPOT (the duration of decode-only steps) with the
offload counters. On CPU the "device" is host memory too: the numbers are the cost of
the extra copies (and of the copy thread competing for cores), not of a PCIe transfer.

Usage: .venv/bin/python bench/weight_offload_cost.py [--rounds 3] [--tokens 64] [--seqs 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from tierguard.common.percentile import percentile
from tierguard.common.units import GIB
from tierguard.engine.api import SamplingParams, StepStats
from tierguard.engine.factory import build_engine
from tierguard.engine.weight_offload import layer_bytes
from tierguard.model.tiny import create_tiny, ensure_tiny_model


def _quantile(xs: list[float], q: float) -> float:
    return percentile(xs, 100 * q)  # type: ignore[return-value]


def run_model(model_dir, name: str, rounds: int, tokens: int, seqs: int, device: str) -> dict:
    probe = build_engine(model_dir, dtype="float32", device=device, kv_cache_gib=0.05, num_threads=1)
    n_layers = len(probe.runner.model.layers)
    per_layer = layer_bytes(probe.runner.model.layers[0])
    del probe
    settings = {"none": 0, "half": n_layers // 2, "all": n_layers}
    engines, tpots = {}, {}
    for label, k in settings.items():
        engines[label] = build_engine(
            model_dir,
            dtype="float32",
            device=device,
            kv_cache_gib=0.05,
            num_threads=1,
            weights_offload_gib=k * per_layer / GIB if k else None,
        )
        tpots[label] = []

        def on_step(s: StepStats, out=tpots[label]) -> None:
            if s.num_prefill_seqs == 0 and s.num_decode_seqs:
                out.append(s.duration_s)

        engines[label].add_step_listener(on_step)
    g = torch.Generator().manual_seed(0)
    vocab = engines["none"].model_config.vocab_size
    prompts = [torch.randint(5, vocab, (64,), generator=g).tolist() for _ in range(seqs)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outputs = {}
    for _ in range(rounds):
        for label, engine in engines.items():
            outputs[label] = engine.generate(prompts, params)
    base = statistics.median(tpots["none"])
    rows = {}
    for label, engine in engines.items():
        extra = engine.stats().extra
        decode_steps = len(tpots[label])
        rows[label] = {
            "layers_offloaded": settings[label],
            "host_bytes": int(extra.get("weights_offload_bytes", 0)),
            "tpot_median_ms": round(statistics.median(tpots[label]) * 1e3, 3),
            "tpot_p99_ms": round(_quantile(tpots[label], 0.99) * 1e3, 3),
            "tpot_vs_none": round(statistics.median(tpots[label]) / base, 3),
            "copies_total": int(extra.get("weights_offload_copies_total", 0)),
            "copy_ms_per_decode_step": round(
                extra.get("weights_offload_copy_seconds_total", 0.0) * 1e3 / max(1, decode_steps), 3
            ),
            "wait_ms_per_decode_step": round(
                extra.get("weights_offload_wait_seconds_total", 0.0) * 1e3 / max(1, decode_steps), 3
            ),
            "same_tokens_as_none": outputs[label] == outputs["none"],
        }
    return {
        "model": name,
        "layers": n_layers,
        "layer_mib": round(per_layer / 2**20, 3),
        "device": str(engines["none"].runner.device),
        "decode_batch": seqs,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per sequence")
    ap.add_argument("--seqs", type=int, default=4, help="sequences decoded together")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    results = [run_model(ensure_tiny_model(), "tiny", args.rounds, args.tokens, args.seqs, args.device)]
    with tempfile.TemporaryDirectory() as tmp:
        larger = create_tiny(
            tmp, layers=8, hidden=1024, heads=16, kv_heads=4, vocab=4096, max_position_embeddings=2048, seed=1
        )
        results.append(run_model(larger, "tiny-larger", args.rounds, args.tokens, args.seqs, args.device))
    print(
        json.dumps({"note": "on CPU this measures copy cost only (host->host)", "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
