"""report.md: the same tables as the HTML, plots linked as PNG files beside it."""

from __future__ import annotations

from tierguard.report.load import RunData
from tierguard.report.tables import Table


def _md_cell(x: str) -> str:
    return x.replace("|", "\\|").replace("\n", " ")


def table_md(t: Table) -> str:
    lines = [f"## {t.title}", ""]
    if t.rows:
        lines.append("| " + " | ".join(_md_cell(h) for h in t.header) + " |")
        lines.append("|" + "---|" * len(t.header))
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in t.rows]
        lines.append("")
    if t.note:
        lines += [t.note, ""]
    return "\n".join(lines)


def render_markdown(
    data: RunData, tables: dict[str, Table], plot_files: dict[str, tuple[str, str]], recs: list[str]
) -> str:
    out = [f"# tierguard {'prediction' if data.predicted else 'sweep'}: {data.matrix.name}", ""]
    out.append(table_md(tables["boundary"]))
    if "predicted" in tables:
        out.append(table_md(tables["predicted"]))
    if recs:  # after the table it rests on
        out += ["## Recommendation", ""] + [f"- {r}" for r in recs] + [""]
    out.append(table_md(tables["single"]))
    if "prefix" in tables and tables["prefix"].rows:
        out.append(table_md(tables["prefix"]))
    if "kvcheck" in tables:
        out.append(table_md(tables["kvcheck"]))
    if plot_files:
        out += ["## Plots", ""]
        out += [f"![{caption}]({path})" for caption, path in plot_files.values()]
        out.append("")
    for key in ("cells", "mixed", "counters", "engines", "environment"):
        if key in tables and (tables[key].rows or key == "counters"):
            out.append(table_md(tables[key]))
    topo = data.environment.get("topology") or {}
    for name, text in topo.items():
        out += [f"### {name}", "", "```", text, "```", ""]
    return "\n".join(out)
