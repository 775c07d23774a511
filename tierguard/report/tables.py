"""The report's tables as plain rows of strings, shared by the HTML and Markdown writers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from tierguard.report.load import RunData, VariantData
from tierguard.sweep.cells import CellSpec, CellVerdict
from tierguard.sweep.stats import P99, pooled, quantile


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""


def fmt_ms(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def fmt_p99(p: P99 | None) -> str:
    if p is None:
        return "-"
    if p.low is None or p.high is None:
        return fmt_ms(p.value)
    return f"{fmt_ms(p.value)} [{fmt_ms(p.low)}, {fmt_ms(p.high)}]"


def boundary_cell(v: VariantData, ctx: int) -> str:
    if v.status == "failed" and ctx not in v.boundaries:
        return "failed"
    b = v.boundaries.get(ctx)
    if not b:
        return "not run"
    best = b.get("max_concurrency")
    lo, hi = (b.get("uncertainty") or {}).get("range") or [None, None]
    if best is None:
        text = "none"
    elif b.get("ceiling_reached"):
        text = f">= {best}"
    else:
        text = str(best)
    if b.get("limited_by"):
        text += f" ({'+'.join(b['limited_by'])})"
    if best is not None and lo != best:
        text += f"; sure up to {lo if lo is not None else 'none'}"
    first = b.get("first_failing")
    if first is not None and hi is None:
        text += f"; miss at {first} uncertain"
    elif first is not None and hi is not None and hi + 1 != first:
        text += f"; sure miss from {hi + 1}"
    return text


def boundary_table(data: RunData) -> Table:
    ctxs = data.matrix.profile.context_lengths
    rows = [[v.name, v.status] + [boundary_cell(v, c) for c in ctxs] for v in data.variants]
    slo = data.matrix.slo.limits()
    note = (
        "Highest concurrency at which every SLO held ("
        + ", ".join(f"p99 {k} <= {v:g} ms" for k, v in slo.items())
        + "); failed or rejected requests count as misses. '(ttft)' names the SLO that broke first; "
        "'sure up to' / 'uncertain' mark cells whose bootstrap interval straddles the limit; "
        "'>= N' means the ladder top still passed."
    )
    title = "Boundary"
    if data.predicted:
        title = "Boundary (predicted: simulated, not measured)"
        note += (" Predicted: every cell was simulated (`tierguard predict`); 'sure up to' and 'sure miss from' "
                 "give the band, the boundary with every cost scaled by 1 + band and 1 - band.")
    return Table(title, ["variant", "status"] + [f"ctx {c}" for c in ctxs], rows, note)


def single_table(data: RunData) -> Table:
    ctxs = data.matrix.profile.context_lengths
    rows = []
    for v in data.variants:
        row = [v.name]
        for c in ctxs:
            cell = v.cells.get(CellSpec("ladder", c, 1).key)
            row.append(f"{fmt_ms(cell.p99['ttft'].value)} / {fmt_ms(cell.p99['itl'].value)}" if cell else "-")
        rows.append(row)
    return Table(
        "Single request (pure cost): p99 TTFT / p99 ITL, ms", ["variant"] + [f"ctx {c}" for c in ctxs], rows
    )


def _cell_row(v: VariantData, c: CellVerdict) -> list[str]:
    verdict = "pass" if c.passed else "MISS " + "+".join(c.missed)
    if not c.confident:
        verdict += " (uncertain)"
    if c.error:
        verdict += f" [{c.error.splitlines()[-1][-160:]}]"
    return [
        v.name,
        str(c.context),
        str(c.concurrency),
        str(c.completed),
        str(c.failed),
        fmt_p99(c.p99.get("ttft")),
        fmt_p99(c.p99.get("itl")),
        fmt_p99(c.p99.get("tpot")),
        fmt_p99(c.p99.get("e2el")),
        fmt_ms(c.max_stall_ms),
        verdict,
    ]


CELL_HEADER = [
    "variant",
    "context",
    "concurrency",
    "ok",
    "failed",
    "p99 TTFT ms [CI]",
    "p99 ITL ms [CI]",
    "p99 TPOT ms",
    "p99 E2EL ms",
    "max stall ms",
    "verdict",
]


def cells_table(data: RunData, slice_name: str) -> Table:
    rows = []
    for v in data.variants:
        for c in sorted(v.cells.values(), key=lambda c: (c.context, c.concurrency)):
            if c.slice == slice_name:
                rows.append(_cell_row(v, c))
    title = "Every cell of the concurrency ladder" if slice_name == "ladder" else "Mixed profile"
    note = ""
    if slice_name == "mixed" and data.matrix.slices.mixed:
        m = data.matrix.slices.mixed
        note = f"{m.long_share:.0%} of requests at {m.long_len} tokens among {m.short_len}-token requests."
    return Table(title, CELL_HEADER, rows, note)


def prefix_p50_ttft(data: RunData, v: VariantData, c: CellVerdict) -> float | None:
    """Median TTFT of a prefix-slice cell: the typical request, a reuse. (Its p99 is set by
    the first, cold use of each prefix, which no tier can help.)"""
    values = pooled(data.samples(v.name, c.key), "ttft")
    q = quantile(values, 0.5)
    return q if math.isfinite(q) else None  # inf: most requests failed, there is no typical reuse


def prefix_table(data: RunData) -> Table:
    """The prefix-reuse slice: does a tier turn recompute into loads?"""
    pre = data.matrix.slices.prefix
    rows = []
    for v in data.variants:
        for c in sorted(v.cells.values(), key=lambda c: c.concurrency):
            if c.slice != "prefix":
                continue
            row = _cell_row(v, c)
            rows.append(row[:5] + [fmt_ms(prefix_p50_ttft(data, v, c))] + row[5:])
    note = ""
    if pre is not None:
        note = (
            f"{pre.num_prefixes} prefixes of {pre.prefix_len} tokens ({pre.num_prefixes * pre.prefix_len} "
            f"prefix tokens), interleaved, each reused by {pre.requests_per_prefix} requests of {pre.context} "
            "tokens. The first use of each prefix is a full prefill for every variant and sets the p99; "
            "p50 TTFT shows the reuses: recomputed, kept in VRAM, or loaded from a tier."
        )
    header = CELL_HEADER[:5] + ["p50 TTFT ms"] + CELL_HEADER[5:]
    return Table("Prefix reuse (beside the boundary)", header, rows, note)


def counters_table(data: RunData, limit: int = 40) -> Table:
    rows = []
    for v in data.variants:
        for name, labels, value in v.counters[:limit]:
            rows.append([v.name, name, labels, f"{value:g}"])
    return Table(
        "Tier and engine counters (/metrics after the last cell)",
        ["variant", "metric", "labels", "value"],
        rows,
        "" if rows else "No variant exposed /metrics with tier, cache or queue counters.",
    )


def engines_table(data: RunData) -> Table:
    rows = []
    for v in data.variants:
        e = v.engine
        cmd = e.get("command")
        cmd_text = " ".join(cmd) if isinstance(cmd, list) else (e.get("base_url") or "")
        version = e.get("version")
        version_text = json.dumps(version)[:80] if isinstance(version, (dict, list)) else str(version or "-")
        rows.append(
            [
                v.name,
                v.description or "-",
                cmd_text,
                version_text,
                str(e.get("model") or "-"),
                str(e.get("ready_s", "-")),
                str(e.get("stop", "-")),
                v.error or "",
            ]
        )
    return Table(
        "Variants and engines",
        ["variant", "what", "command / URL", "version", "model", "ready s", "stopped by", "error"],
        rows,
    )


def environment_table(data: RunData) -> Table:
    env = data.environment
    keys = ["captured_at", "tierguard", "python", "os", "cpu", "cpu_count", "host_ram_bytes"]
    rows = [[k, str(env.get(k, "-"))] for k in keys]
    p = data.matrix.profile
    rows.append(
        [
            "profile",
            f"{p.dataset}, output {p.output_len} tokens, temperature {p.temperature:g}, "
            f"seed {p.seed}, ignore_eos {p.ignore_eos}, >= {p.num_requests} requests per cell",
        ]
    )
    return Table("Environment", ["item", "value"], rows)
