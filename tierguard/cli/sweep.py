"""`tierguard sweep MATRIX.yaml`: run a variant matrix and find each variant's boundary.

Resumable: rerun the same command after an interruption and only missing cells run.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from tierguard.common.errors import TierguardError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sweep",
        help="run a variant matrix and find the degradation boundary",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("matrix", metavar="MATRIX.yaml", help="matrix file (see examples/)")
    p.add_argument("--run-dir", default=None, help="run directory (default: ./tierguard-runs/<matrix name>)")
    p.add_argument(
        "--fresh", action="store_true", help="discard an earlier sweep in --run-dir instead of resuming"
    )
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument(
        "--predict-first",
        action="store_true",
        help="predict every boundary first (`tierguard predict`, into RUN_DIR/predicted) and measure only "
        "around the prediction",
    )
    p.add_argument("--calibration-dir", default=None, help="with --predict-first: the calibration cache")
    return p


class Progress:
    """rich progress: one task per variant, advanced per cell."""

    def __init__(self, matrix) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self.console = Console()
        self.bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        # An estimate: the ladder (+ bisection steps) per context, plus the mixed and prefix cells.
        per_ctx = len(matrix.slices.ladder) + (2 if matrix.slices.bisect else 0)
        mixed = len(matrix.slices.mixed.concurrency) if matrix.slices.mixed else 0
        mixed += len(matrix.slices.prefix.concurrency) if matrix.slices.prefix else 0
        self.total = per_ctx * len(matrix.profile.context_lengths) + mixed
        self.tasks: dict[str, int] = {}

    def _task(self, variant: str) -> int:
        if variant not in self.tasks:
            self.tasks[variant] = self.bar.add_task(variant, total=self.total)
        return self.tasks[variant]

    def __call__(self, kind: str, **kw) -> None:
        v = kw.get("variant", "")
        if kind == "engine_starting":
            self.bar.update(self._task(v), description=f"{v}: starting engine")
        elif kind == "engine_ready":
            self.bar.update(self._task(v), description=f"{v}: ready in {kw['info'].get('ready_s', '?')}s")
        elif kind == "cell_start":
            s = kw["spec"]
            self.bar.update(self._task(v), description=f"{v}: {s.slice} ctx {s.context} c {s.concurrency}")
        elif kind in ("cell_done", "cell_cached"):
            c = kw["verdict"]
            ttft = c.p99["ttft"].value if "ttft" in c.p99 else float("nan")
            self.bar.update(
                self._task(v),
                advance=1,
                description=f"{v}: c {c.concurrency} p99 TTFT {ttft:.0f} ms "
                + ("pass" if c.passed else "miss"),
            )
        elif kind == "boundary":
            b = kw["boundary"]
            self.console.print(f"{v}: context {b.context} -> boundary {b.max_concurrency}")
        elif kind == "variant_failed":
            self.bar.update(self._task(v), description=f"{v}: FAILED")
            self.console.print(f"[red]{v} failed:[/red] {kw['error']}")
        elif kind == "variant_skipped":
            self.console.print(f"{v}: already {kw['status']} (resumed)")


def default_run_dir(name: str) -> Path:
    return Path("tierguard-runs") / (re.sub(r"[^A-Za-z0-9_.-]+", "-", name) or "sweep")


def run(args: argparse.Namespace) -> int:
    from tierguard.sweep.matrix import load_matrix, read_matrix_text

    matrix = load_matrix(args.matrix)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(matrix.name)
    if args.fresh and run_dir.exists():
        if not (run_dir / "state.json").exists():
            raise TierguardError(f"--fresh: {run_dir} is not a sweep run directory; not deleting it")
        shutil.rmtree(run_dir)
    try:  # fail now with one line, not with a traceback once the first engine is up
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TierguardError(f"--run-dir {str(run_dir)!r} cannot be created: {exc.strerror or exc}") from None
    text = read_matrix_text(args.matrix)
    predicted = None
    if args.predict_first:
        predicted = predict_first(matrix, run_dir, text, args.calibration_dir)
    return run_sweep(matrix, run_dir, text, report=not args.no_report, predicted=predicted)


def predict_first(matrix, run_dir: Path, matrix_text: str, calibration_dir: str | None) -> dict:
    """Predict into RUN_DIR/predicted (kept for the report's overlay); returns, per variant
    and context, (predicted boundary, predicted first failing concurrency)."""
    import sys
    import time

    from tierguard.cli.predict import prepare_run_dir
    from tierguard.predict.calibrate import default_cache_dir
    from tierguard.predict.predictor import predict_matrix

    pdir = run_dir / "predicted"
    t0 = time.monotonic()
    prepare_run_dir(pdir)
    cache = Path(calibration_dir) if calibration_dir else default_cache_dir()
    doc = predict_matrix(matrix, pdir, cache, lambda m: print(m, file=sys.stderr, flush=True), matrix_text)
    out: dict = {}
    for name, v in doc["variants"].items():
        for ctx, b in (v.get("contexts") or {}).items():
            if b:
                out.setdefault(name, {})[int(ctx)] = (b.get("max_concurrency"), b.get("first_failing"))
    (run_dir / "predict_first.json").write_text(json.dumps(
        {"predict_s": round(time.monotonic() - t0, 1), "predicted": {n: {str(c): list(g) for c, g in d.items()}
                                                                    for n, d in out.items()}}, indent=1))
    return out


def run_sweep(matrix, run_dir: Path, matrix_text: str | None, report: bool = True, show: bool = True,
              predicted: dict | None = None) -> int:
    """Run (or resume) a sweep with a progress bar, then print the boundary and write the report."""
    from tierguard.cli.report import print_boundary
    from tierguard.sweep.runner import Sweep

    progress = Progress(matrix)
    with progress.bar:
        doc = Sweep(matrix, run_dir, on_event=progress, matrix_text=matrix_text, predicted=predicted).run()
    recs: list[str] = []
    if report:
        from tierguard.report import write_report

        files = write_report(run_dir)
        recs = files.recommendations
    if show:
        print_boundary(run_dir, recs)
        print(f"run directory: {run_dir}")
        if report:
            print(f"report: {run_dir / 'report' / 'report.html'}")
    failed = [n for n, v in doc["variants"].items() if v["status"] == "failed"]
    return 1 if failed and len(failed) == len(doc["variants"]) else 0
