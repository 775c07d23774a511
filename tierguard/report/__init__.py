"""Reports of a sweep: report.html (self-contained), report.md, PNG plots, boundary.json.

load.py      -- read the run directory (state, cells, /metrics scrapes, environment)
tables.py    -- the tables as rows of strings
plots.py     -- matplotlib (Agg) PNGs
recommend.py -- boundaries -> decisions in the article's terms
html.py, markdown.py -- the two renderings
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class ReportFiles:
    html: Path
    markdown: Path
    boundary_json: Path
    plots: list[Path]
    recommendations: list[str]


def write_report(run_dir: Path, out_dir: Path | None = None, compare: Path | None = None) -> ReportFiles:
    """Write the report of `run_dir` into `out_dir` (default RUN_DIR/report). A prediction
    (`compare`, or RUN_DIR/predicted when it exists) or the measured sweep a prediction
    is compared with is drawn on the same plots, with a table of the errors."""
    from tierguard.report.html import render_html
    from tierguard.report.load import load_run, with_companion, write_boundary_json
    from tierguard.report.markdown import render_markdown
    from tierguard.report.plots import all_plots
    from tierguard.report.recommend import recommendations
    from tierguard.report.tables import (
        boundary_table,
        cells_table,
        counters_table,
        engines_table,
        environment_table,
        prefix_table,
        single_table,
    )

    data = with_companion(load_run(Path(run_dir)), compare)
    out = Path(out_dir) if out_dir else Path(run_dir) / "report"
    (out / "plots").mkdir(parents=True, exist_ok=True)
    tables = {
        "boundary": boundary_table(data),
        "single": single_table(data),
        "cells": cells_table(data, "ladder"),
        "mixed": cells_table(data, "mixed"),
        "prefix": prefix_table(data),
        "counters": counters_table(data),
        "engines": engines_table(data),
        "environment": environment_table(data),
    }
    from tierguard.report.predicted import comparison_table

    versus = comparison_table(data)
    if versus is not None:
        tables["predicted"] = versus
    plots = all_plots(data)
    from tierguard.kvcheck.check import report_section

    kvcheck = report_section(Path(run_dir))  # the demo's real-model section, when it ran
    if kvcheck is not None:
        tables["kvcheck"], plots["kvcheck"] = kvcheck
    recs = recommendations(data)
    plot_paths, plot_files = [], {}
    for name, (caption, png) in plots.items():
        p = out / "plots" / f"{name}.png"
        p.write_bytes(png)
        plot_paths.append(p)
        plot_files[name] = (caption, f"plots/{name}.png")
    html_path = out / "report.html"
    html_path.write_text(render_html(data, tables, plots, recs), encoding="utf-8")
    md_path = out / "report.md"
    md_path.write_text(render_markdown(data, tables, plot_files, recs), encoding="utf-8")
    bj = out / "boundary.json"
    write_boundary_json(data, bj)
    return ReportFiles(html_path, md_path, bj, plot_paths, recs)
