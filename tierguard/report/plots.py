"""The report's plots, drawn with matplotlib's Agg backend into PNG bytes.

Each function returns PNG bytes or None when there is nothing to draw, so the HTML and
Markdown writers can embed or link exactly the plots that exist. A p99 that is
unbounded (more than 1 % of requests failed) is drawn as an 'x' at the top edge.
"""

from __future__ import annotations

import io
import math

import numpy as np

from tierguard.report.load import RunData
from tierguard.sweep.cells import CellSpec
from tierguard.sweep.stats import cdf_points, pooled

LIMIT_OF = {"ttft": "p99_ttft_ms", "itl": "p99_itl_ms"}
LABEL = {"ttft": "p99 TTFT (ms)", "itl": "p99 ITL per token (ms)"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def _p99(cell, metric: str) -> float:
    return cell.p99[metric].value if metric in cell.p99 else math.nan


def _side(data: RunData) -> str:
    return "predicted" if data.predicted else "measured"


def p99_vs_concurrency(data: RunData, metric: str) -> bytes | None:
    """One panel per context length, one line per variant, the SLO as a dashed line; with
    a companion run (a prediction beside a sweep), its lines dotted in the same colours."""
    contexts = data.matrix.profile.context_lengths
    if not any(v.ladder(c) for v in data.variants for c in contexts):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.4), squeeze=False)
    limit = getattr(data.matrix.slo, LIMIT_OF[metric])
    for ax, ctx in zip(axes[0], contexts, strict=True):
        finite_max = limit
        comp = {v.name: v for v in data.companion.variants} if data.companion else {}
        suffix = f" ({_side(data)})" if data.companion else ""
        for v in data.variants:
            pts = v.ladder(ctx)
            xs = [p.concurrency for p in pts]
            ys = [_p99(p, metric) for p in pts]
            finite_max = max([finite_max] + [y for y in ys if math.isfinite(y)])
            color = None
            if xs:
                (line,) = ax.plot(xs, [y if math.isfinite(y) else np.nan for y in ys], marker="o", label=v.name + suffix)
                color = line.get_color()
            other = comp.get(v.name)
            if other is not None and other.ladder(ctx):
                opts = other.ladder(ctx)
                oys = [_p99(p, metric) for p in opts]
                finite_max = max([finite_max] + [y for y in oys if math.isfinite(y)])
                ax.plot([p.concurrency for p in opts], [y if math.isfinite(y) else np.nan for y in oys], ":",
                        marker="s", markersize=3, color=color, label=f"{v.name} ({_side(data.companion)})")
        top = finite_max * 1.15
        for v in data.variants:
            bad = [p.concurrency for p in v.ladder(ctx) if math.isinf(_p99(p, metric))]
            if bad:
                ax.plot(bad, [top] * len(bad), "x", color="red", markersize=9)
        ax.axhline(limit, linestyle="--", color="black", linewidth=1, label="SLO")
        ax.set_ylim(0, top * 1.08)
        ax.set_xscale("log", base=2)
        ax.set_title(f"context {ctx} tokens")
        ax.set_xlabel("concurrency")
        ax.set_ylabel(LABEL[metric])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return _png(fig)


def common_concurrency(data: RunData, ctx: int) -> int | None:
    """The highest concurrency evaluated by every variant that has cells at `ctx`."""
    sets = [{p.concurrency for p in v.ladder(ctx)} for v in data.variants if v.ladder(ctx)]
    if not sets:
        return None
    common = set.intersection(*sets)
    return max(common) if common else None


def latency_cdfs(data: RunData, metric: str) -> bytes | None:
    """CDF of per-request TTFT (or per-token ITL), per variant, at a shared concurrency."""
    contexts = data.matrix.profile.context_lengths
    plt = _plt()
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.2), squeeze=False)
    drew = False
    for ax, ctx in zip(axes[0], contexts, strict=True):
        c = common_concurrency(data, ctx)
        if c is None:
            ax.set_visible(False)
            continue
        here = False
        for v in data.variants:
            xs, ys = cdf_points(pooled(data.samples(v.name, CellSpec("ladder", ctx, c).key), metric))
            if xs:
                ax.plot(xs, ys, label=v.name)
                drew = here = True
        ax.ticklabel_format(axis="x", useOffset=False, style="plain")
        ax.set_title(f"context {ctx}, concurrency {c}")
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if metric == "ttft" else "tokens"))
        ax.grid(alpha=0.3)
        if here:
            ax.legend(fontsize=7)
    if not drew:
        _plt().close(fig)
        return None
    return _png(fig)


def stall_distribution(data: RunData) -> bytes | None:
    """Per-request longest stall (beyond the stream's own cadence), over all ladder cells."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    drew = False
    for v in data.variants:
        stalls = []
        for key, cell in v.cells.items():
            if cell.slice == "ladder":
                stalls += [
                    s.max_stall_ms
                    for s in data.samples(v.name, key)
                    if s.ok and math.isfinite(s.max_stall_ms)
                ]
        xs, ys = cdf_points(np.asarray(stalls, dtype=float))
        if xs:
            ax.plot(xs, ys, label=v.name)
            drew = True
    if not drew:
        plt.close(fig)
        return None
    ax.ticklabel_format(axis="x", useOffset=False, style="plain")
    ax.set_xlabel("longest stall of a request (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("max-stall distribution (all ladder cells)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def boundary_bars(data: RunData) -> bytes | None:
    """Highest concurrency meeting every SLO, per context and variant (0 = none did)."""
    contexts = data.matrix.profile.context_lengths
    if not any(v.boundaries for v in data.variants):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(contexts) * len(data.variants) / 2), 3.2))
    shown = [v for v in data.variants if v.boundaries]
    width = 0.8 / max(1, len(shown))
    for i, v in enumerate(shown):
        ys = [(v.boundaries.get(c) or {}).get("max_concurrency") or 0 for c in contexts]
        ax.bar(np.arange(len(contexts)) + i * width, ys, width, label=v.name)
    ax.set_xticks(np.arange(len(contexts)) + width * (len(shown) - 1) / 2)
    ax.set_xticklabels([f"{c}" for c in contexts])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("max concurrency within SLO")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return _png(fig)


def all_plots(data: RunData) -> dict[str, tuple[str, bytes]]:
    """name -> (caption, png) for every plot that has data."""
    made = {
        "boundary": ("Degradation boundary: highest concurrency meeting every SLO", boundary_bars(data)),
        "p99_ttft": ("p99 TTFT vs concurrency", p99_vs_concurrency(data, "ttft")),
        "p99_itl": ("p99 ITL (per token) vs concurrency", p99_vs_concurrency(data, "itl")),
        "cdf_ttft": ("TTFT CDF at a concurrency every variant ran", latency_cdfs(data, "ttft")),
        "cdf_itl": ("ITL CDF at a concurrency every variant ran", latency_cdfs(data, "itl")),
        "stalls": ("Max-stall distribution", stall_distribution(data)),
    }
    return {k: (cap, png) for k, (cap, png) in made.items() if png}
