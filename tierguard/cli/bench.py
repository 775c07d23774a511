"""`tierguard bench`: open-loop load against any OpenAI-compatible server, timed per token."""

from __future__ import annotations

import argparse
import math

from tierguard.common.errors import TierguardError
from tierguard.common.units import parse_tokens


def _rate(text: str) -> float:
    if str(text).strip().lower() in ("inf", "infinity"):
        return math.inf
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid rate {text!r}: expected requests/s or inf") from None


def _tokens(text: str) -> int:
    try:
        return parse_tokens(text)
    except TierguardError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="open-loop load generator with honest per-token timing",
                              description=__doc__)
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    s.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    s.add_argument("--api-key", default=None)
    s.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    s.add_argument("--http-client", default="auto", choices=["auto", "aiohttp"],
                   help="auto: tierguard's lean asyncio client for http:// (aiohttp for https://)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="random", choices=["random", "fixed", "mixed", "shared-prefix", "sessions", "trace"])
    w.add_argument("--input-len", type=_tokens, default=1024)
    w.add_argument("--output-len", type=_tokens, default=128)
    w.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len×(1±ratio)")
    w.add_argument("--long-share", type=float, default=0.05, help="mixed: share of long requests")
    w.add_argument("--long-input-len", type=_tokens, default=32768, help="mixed: input length of long requests")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    w.add_argument("--prefix-len", type=_tokens, default=1024, help="shared-prefix: prefix length")
    w.add_argument("--requests-per-prefix", type=int, default=8, help="shared-prefix: requests per prefix")
    w.add_argument("--num-sessions", type=int, default=8, help="sessions: conversations")
    w.add_argument("--turns", type=int, default=4, help="sessions: turns per conversation")
    w.add_argument("--trace", default=None, metavar="FILE", help="trace: JSONL with arrival_s/timestamp, input_len, output_len")
    w.add_argument("--tokenizer", default=None, metavar="DIR", help="local dir with tokenizer.json, a .gguf file, 'tiny' or 'smollm2' (exact lengths)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    w.add_argument("--temperature", type=float, default=0.0)
    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (Poisson/gamma) or inf")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    ld.add_argument("--max-concurrency", type=int, default=None, help="client-side limit on requests in flight")
    ld.add_argument("--num-requests", type=int, default=None)
    ld.add_argument("--duration", type=float, default=None, help="seconds of load (instead of --num-requests)")
    ld.add_argument("--warmup", default="0", help="excluded from stats: N requests or Ss seconds")
    ld.add_argument("--cooldown", default="0", help="excluded from stats: last N requests or Ss seconds")
    ld.add_argument("--workers", type=int, default=1, help="client processes sharing the schedule")
    o = p.add_argument_group("output")
    o.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft=500,itl=50,tpot=40,e2el=20000")
    o.add_argument("--output-dir", default=None, help="write requests.jsonl, summary.json, run.json here")
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")
    o.add_argument("--json", action="store_true", help="print summary.json to stdout")
    return p


def config_from_args(args: argparse.Namespace):
    from tierguard.bench.config import BenchConfig, parse_slo

    return BenchConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, api_key=args.api_key, dataset=args.dataset,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        num_requests=args.num_requests, duration=args.duration, warmup=args.warmup, cooldown=args.cooldown,
        seed=args.seed, tokenizer=args.tokenizer, slo=parse_slo(args.slo), output_dir=args.output_dir,
        workers=args.workers, ignore_eos=args.ignore_eos, timeout=args.timeout, temperature=args.temperature,
        long_share=args.long_share, long_input_len=args.long_input_len, num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len, requests_per_prefix=args.requests_per_prefix, num_sessions=args.num_sessions,
        turns=args.turns, trace=args.trace, show_progress=not args.no_progress, http_client=args.http_client,
    )


def run(args: argparse.Namespace) -> int:
    import json

    from tierguard.bench.progress import print_final
    from tierguard.bench.runner import run_bench

    result = run_bench(config_from_args(args).validate())
    s = result.summary
    if args.json:
        print(json.dumps(s, indent=2, default=str))
    print_final(s, str(result.output_dir) if result.output_dir else None)
    if result.interrupted:
        print("tierguard: interrupted; partial results written" if result.output_dir else "tierguard: interrupted")
        return 130
    if s["completed"] == 0 and s["num_prompts"]:
        first = next(iter(s["errors"]), "unknown error")
        where = f" (partial results in {result.output_dir})" if result.output_dir else ""
        raise TierguardError(f"all {s['num_prompts']} requests failed: {first}{where}")
    return 0
