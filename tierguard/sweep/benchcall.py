"""Run `tierguard bench` for one cell, as a subprocess with its own --output-dir.

Why a subprocess: the load generator must own its event loop and CPU (its self-check
flags distorted runs), and a crash in one cell must not take the sweep down. The
argument list is built from the matrix profile only (plus the engine's URL and served
model name), so every variant receives exactly the same workload (R10).
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tierguard.sweep.cells import CellSpec
from tierguard.sweep.matrix import Matrix


@dataclass
class BenchOutcome:
    exit_code: int | None  # None: killed after the timeout
    error: str | None  # None when the run finished cleanly


def cell_seed(base: int, spec: CellSpec, repeat: int) -> int:
    """A seed per cell and repeat, the same for every variant.

    Why not one seed for all cells: cells run one after another on the same engine, and
    identical prompts would turn every later cell into a prefix-cache hit of an earlier one.
    """
    digest = hashlib.sha256(f"{spec.key}/{repeat}".encode()).digest()
    return base + int.from_bytes(digest[:3], "big")


def cell_requests(matrix: Matrix, spec: CellSpec) -> int:
    """How many measured requests a cell sends: the prefix slice fixes its own count."""
    pre = matrix.slices.prefix
    if spec.slice == "prefix" and pre is not None:
        return pre.num_requests
    return matrix.profile.requests_for(spec.concurrency)


def bench_argv(
    matrix: Matrix, spec: CellSpec, base_url: str, model: str | None, out_dir: Path, repeat: int = 0
) -> list[str]:
    """The full `tierguard bench` command line of a cell (without the interpreter)."""
    p, slo = matrix.profile, matrix.slo
    rate = "inf" if math.isinf(p.request_rate) else f"{p.request_rate:g}"
    pre = matrix.slices.prefix if spec.slice == "prefix" else None
    argv = [
        "bench",
        "--base-url",
        base_url,
        "--endpoint",
        p.endpoint,
        "--max-concurrency",
        str(spec.concurrency),
        "--request-rate",
        rate,
        "--num-requests",
        str(cell_requests(matrix, spec)),
        "--output-len",
        str(p.output_len),
        "--seed",
        str(cell_seed(p.seed, spec, repeat)),
        "--temperature",
        f"{p.temperature:g}",
        "--timeout",
        f"{p.timeout_s:g}",
        "--output-dir",
        str(out_dir),
        "--no-progress",
    ]
    if spec.slice == "mixed" and matrix.slices.mixed is not None:
        m = matrix.slices.mixed
        argv += [
            "--dataset",
            "mixed",
            "--input-len",
            str(m.short_len),
            "--long-input-len",
            str(m.long_len),
            "--long-share",
            f"{m.long_share:g}",
        ]
    elif pre is not None:
        argv += _shared_prefix_args(pre.prefix_len, pre.context, pre.num_prefixes, pre.requests_per_prefix)
    elif p.dataset == "shared-prefix":
        # Enough prefixes x requests per prefix to cover the cell's request count.
        per_prefix = -(-p.requests_for(spec.concurrency) // p.num_prefixes)
        argv += _shared_prefix_args(p.prefix_len(spec.context), spec.context, p.num_prefixes, per_prefix)
    else:
        argv += ["--dataset", p.dataset, "--input-len", str(spec.context)]
        if p.dataset == "random":
            argv += ["--range-ratio", f"{p.range_ratio:g}"]
    if p.warmup_requests:
        argv += ["--warmup", str(p.warmup_requests)]
    if not p.ignore_eos:
        argv += ["--no-ignore-eos"]
    if model:
        argv += ["--model", model]
    if p.tokenizer == "tiny":  # the built-in model's tokenizer; resolved here so the matrix stays as written
        from tierguard.model.tiny import ensure_tiny_model

        argv += ["--tokenizer", str(ensure_tiny_model())]
    elif p.tokenizer:
        argv += ["--tokenizer", p.tokenizer]
    limits = slo.limits()
    argv += ["--slo", ",".join(f"{k}={v:g}" for k, v in limits.items())]
    return argv + list(p.extra_bench_args)


def _shared_prefix_args(prefix_len: int, context: int, num_prefixes: int, per_prefix: int) -> list[str]:
    """The prompt is prefix + suffix = exactly `context` tokens."""
    return [
        "--dataset",
        "shared-prefix",
        "--prefix-len",
        str(prefix_len),
        "--input-len",
        str(context - prefix_len),
        "--num-prefixes",
        str(num_prefixes),
        "--requests-per-prefix",
        str(per_prefix),
    ]


def run_bench(argv: list[str], log_path: Path, timeout_s: float) -> BenchOutcome:
    """Run `python -m tierguard <argv>`; its output goes to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierguard", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return BenchOutcome(None, f"bench did not finish within {timeout_s:g}s")
    if code == 0:
        return BenchOutcome(0, None)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    return BenchOutcome(code, f"bench exited with code {code}: {' | '.join(tail)}")
