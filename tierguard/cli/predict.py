"""`tierguard predict MATRIX.yaml`: the boundary each variant will have, before running the sweep.

Calibrates each engine with a short probe run (cached), then simulates every cell the
sweep would run; writes the sweep's run-directory layout, marked as predicted, so
`tierguard report DIR` reads it. See docs/predict.md.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from tierguard.common.errors import TierguardError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "predict",
        help="predict each variant's degradation boundary by simulation, before a sweep",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("matrix", metavar="MATRIX.yaml", help="the matrix `tierguard sweep` takes")
    p.add_argument("--run-dir", default=None, help="where to write (default: ./tierguard-runs/<matrix name>-predicted)")
    p.add_argument("--calibration-dir", default=None,
                   help="calibration cache (default: ~/.cache/tierguard/predict)")
    p.add_argument("--variant", action="append", default=None, metavar="NAME", help="only this variant (repeatable)")
    p.add_argument("--ramp", default=None, metavar="C,C,...",
                   help="calibration's closed-loop concurrencies (default: 2,4,8 up to the ladder's top)")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    return p


def default_run_dir(name: str) -> Path:
    return Path("tierguard-runs") / ((re.sub(r"[^A-Za-z0-9_.-]+", "-", name) or "sweep") + "-predicted")


def parse_ramp(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ramp = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise TierguardError(f"--ramp {text!r}: expected concurrencies like 2,4,8") from None
    if not ramp or ramp[0] < 1:
        raise TierguardError(f"--ramp {text!r}: concurrencies must be >= 1")
    return ramp


def prepare_run_dir(run_dir: Path) -> None:
    """An earlier prediction in `run_dir` is replaced (its calibrations stay cached); a
    measured sweep there is refused."""
    if (run_dir / "state.json").exists():
        import json

        state = json.loads((run_dir / "state.json").read_text())
        if not state.get("predicted"):
            raise TierguardError(f"{run_dir} holds a measured sweep; predict into another --run-dir")
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TierguardError(f"--run-dir {str(run_dir)!r} cannot be created: {exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    from tierguard.predict.calibrate import ProbePlan, default_cache_dir
    from tierguard.predict.predictor import predict_matrix
    from tierguard.sweep.matrix import load_matrix, read_matrix_text

    matrix = load_matrix(args.matrix)
    names = {v.name for v in matrix.variants}
    for name in args.variant or []:
        if name not in names:
            raise TierguardError(f"--variant {name!r}: the matrix has {', '.join(sorted(names))}")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(matrix.name)
    prepare_run_dir(run_dir)
    ramp = parse_ramp(args.ramp)
    plan = ProbePlan.for_matrix(matrix, ramp=ramp) if ramp else None
    cache = Path(args.calibration_dir) if args.calibration_dir else default_cache_dir()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    doc = predict_matrix(matrix, run_dir, cache, log, read_matrix_text(args.matrix), args.variant, plan)
    recs: list[str] = []
    if not args.no_report:
        from tierguard.report import write_report

        recs = write_report(run_dir).recommendations
    from tierguard.cli.report import print_boundary

    print_boundary(run_dir, recs)
    print(f"run directory: {run_dir} (predicted)")
    failed = [n for n, v in doc["variants"].items() if v["status"] == "failed"]
    return 1 if failed and len(failed) == len(doc["variants"]) else 0
