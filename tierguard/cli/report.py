"""`tierguard report RUN_DIR`: report.html (self-contained), report.md, PNGs, boundary.json."""

from __future__ import annotations

import argparse
from pathlib import Path

from tierguard.common.errors import TierguardError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report", help="write the report of a sweep run directory", description=__doc__.splitlines()[0]
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory written by `tierguard sweep`")
    p.add_argument("--output-dir", default=None, help="where to write the report (default: RUN_DIR/report)")
    p.add_argument(
        "--compare",
        default=None,
        metavar="DIR",
        help="a prediction (`tierguard predict`) of this sweep, or the sweep this prediction predicted: drawn on "
        "the same plots (default: RUN_DIR/predicted when it exists)",
    )
    return p


def print_boundary(run_dir: Path, recommendations: list[str] | None = None) -> None:
    """The boundary table (and recommendations) on the terminal."""
    from rich.console import Console
    from rich.table import Table as RichTable

    from tierguard.report.load import load_run
    from tierguard.report.tables import boundary_table

    t = boundary_table(load_run(run_dir))
    rt = RichTable(title=t.title)
    for h in t.header:
        rt.add_column(h)
    for row in t.rows:
        rt.add_row(*row)
    console = Console()
    console.print(rt)
    console.print(t.note, style="dim")
    if recommendations:  # after the table it rests on
        console.rule("Recommendation")
        for r in recommendations:
            console.print(f"- {r}")


def run(args: argparse.Namespace) -> int:
    from tierguard.report import write_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise TierguardError(f"run directory {str(run_dir)!r} is not a directory (give the --run-dir of a sweep)")
    compare = Path(args.compare) if args.compare else None
    if compare is not None and not (compare / "state.json").is_file():
        raise TierguardError(f"--compare {str(compare)!r} is not a run directory (no state.json)")
    files = write_report(run_dir, Path(args.output_dir) if args.output_dir else None, compare)
    print_boundary(run_dir, files.recommendations)
    print(f"report:   {files.html}")
    print(f"markdown: {files.markdown}")
    print(f"boundary: {files.boundary_json}")
    print(f"plots:    {len(files.plots)} PNG in {files.html.parent / 'plots'}")
    return 0
