"""`tierguard kvcheck`: KV quantization checked on long-context tasks against the
unquantized pool (R7). Exit 0: every dtype passes; 1: one fails; 2: bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tierguard.common.errors import TierguardError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "kvcheck",
        help="check KV quantization (int8/fp8) on long-context tasks against the unquantized pool",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--model", default="smollm2", help="'smollm2' (default), 'gemma3', 'tiny', a local HF dir or a .gguf file")
    p.add_argument("--kv-dtype", default="int8,fp8", help="KV dtypes to check, comma-separated (int8, fp8)")
    p.add_argument("--contexts", default="1k,2k,4k,8k", help="context lengths in tokens, e.g. 1k,2k,4k,8k")
    p.add_argument("--trials", type=int, default=20, help="passkey trials per context (seeded); 0: perplexity and agreement only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--text", default=None, help="long text for perplexity and haystack (default: /usr/share/common-licenses)"
    )
    p.add_argument("--max-accuracy-drop", type=float, default=5.0, help="points of passkey accuracy a dtype may lose")
    p.add_argument("--max-ppl-increase", type=float, default=2.0, help="percent of perplexity a dtype may add")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument(
        "--chunk", type=int, default=None, help="prefill chunk in tokens, same for every dtype "
        "(default: min(512, shortest context / 4))"
    )
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    p.add_argument("--output-dir", default=None, help="write kvcheck.json, kvcheck.md and kvcheck.png here")
    return p


def spec_from_args(args: argparse.Namespace):
    from tierguard.kvcheck.check import CheckSpec
    from tierguard.kvcheck.inputs import parse_contexts
    from tierguard.kvcheck.verdict import Thresholds

    dtypes = [d.strip() for d in str(args.kv_dtype).split(",") if d.strip()]
    spec = CheckSpec(
        model=args.model,
        kv_dtypes=dtypes,
        contexts=parse_contexts(args.contexts),
        trials=args.trials,
        seed=args.seed,
        text=args.text,
        thresholds=Thresholds(args.max_accuracy_drop, args.max_ppl_increase),
        device=args.device,
        threads=args.threads,
        chunk=args.chunk,
    )
    spec.validate()
    return spec


def print_table(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from tierguard.kvcheck.check import table_rows

    header, body = table_rows(doc)
    t = Table(title=f"kvcheck {doc['model']}: KV dtypes vs the unquantized pool")
    for h in header:
        t.add_column(h)
    for r in body:
        t.add_row(*r)
    console = Console(width=max(Console().width, 110))
    console.print(t)
    th = doc["thresholds"]
    console.print(
        f"text: {doc['text']['name']}; perplexity over {doc['perplexity_window']}; pass = accuracy drop <= "
        f"{th['max_accuracy_drop']} points and perplexity rise <= {th['max_ppl_increase']}% at every context",
        style="dim",
    )
    for name, v in doc["verdicts"].items():
        where = f" (fails at {', '.join(map(str, v['failed_contexts']))})" if v["failed_contexts"] else ""
        console.print(f"{name}: {'PASS' if v['passed'] else 'FAIL'}{where}")


def run(args: argparse.Namespace) -> int:
    from tierguard.kvcheck.check import run_check, write_outputs
    from tierguard.model.registry import check_model_spec

    spec = spec_from_args(args)
    check_model_spec(spec.model)
    out = Path(args.output_dir) if args.output_dir else None
    if out is not None:
        if out.exists() and not out.is_dir():
            raise TierguardError(f"--output-dir {str(out)!r} exists and is not a directory")
        out.mkdir(parents=True, exist_ok=True)  # fail now, not after the run
    def checkpoint(doc: dict) -> None:
        if out is not None:
            write_outputs(doc, out)
        if not args.json and not doc["complete"]:
            print(f"kvcheck: context {doc['contexts'][-1]} done ({doc['timing_s']['total']:.0f} s)", flush=True)

    doc = run_check(spec, checkpoint=checkpoint)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print_table(doc)
    return 0 if doc["passed"] else 1
