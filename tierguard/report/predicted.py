"""A prediction beside the sweep it predicted: boundaries and p99s, side by side.

`boundary_pairs` says, per variant and context, whether the predicted boundary is within
one ladder step of the measured one; `cell_errors` gives the relative error of the
predicted p99 TTFT and p99 ITL at every concurrency both runs have, marked in-sample or
held out (a context or a concurrency the calibration's probes never ran). Used by the
report's table and by bench/predict_validation.py.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from tierguard.report.load import RunData
from tierguard.report.tables import Table, fmt_ms


@dataclass
class BoundaryPair:
    variant: str
    context: int
    measured: int | None
    predicted: int | None
    band: list[int | None]
    steps_apart: float  # distance on the ladder (fractions for bisection points)

    @property
    def within_one_step(self) -> bool:
        return self.steps_apart <= 1.0 + 1e-9


@dataclass
class CellError:
    variant: str
    context: int
    concurrency: int
    metric: str  # ttft | itl
    measured_ms: float
    predicted_ms: float
    held_out: bool

    @property
    def error(self) -> float:
        """(predicted - measured) / measured; inf when one side is unbounded."""
        if not (math.isfinite(self.measured_ms) and math.isfinite(self.predicted_ms)):
            return 0.0 if self.measured_ms == self.predicted_ms else math.inf
        return (self.predicted_ms - self.measured_ms) / max(self.measured_ms, 1e-9)


def ladder_position(ladder: list[int], c: int | None) -> float:
    """Where `c` sits on the ladder: index of the step at or below it, plus the fraction
    of the way to the next step; -1 for None (nothing passed)."""
    if not c:
        return -1.0
    i = bisect.bisect_right(ladder, c) - 1
    if i < 0:
        return -1.0 + c / ladder[0]
    if i + 1 >= len(ladder) or c == ladder[i]:
        return float(i)
    return i + (c - ladder[i]) / (ladder[i + 1] - ladder[i])


def _pairs(a: RunData, b: RunData):
    """(measured variant, its predicted twin, the predicted run) for each variant both have."""
    measured, predicted = (b, a) if a.predicted else (a, b)
    pred = {v.name: v for v in predicted.variants}
    for v in measured.variants:
        if v.name in pred:
            yield v, pred[v.name], predicted


def boundary_pairs(a: RunData, b: RunData) -> list[BoundaryPair]:
    ladder = list(a.matrix.slices.ladder)
    if a.matrix.slices.single and ladder[0] != 1:
        ladder.insert(0, 1)
    out = []
    for v, pv, _predicted in _pairs(a, b):
        for ctx, mb in v.boundaries.items():
            pb = pv.boundaries.get(ctx)
            if not pb or not mb:
                continue
            m, p = mb.get("max_concurrency"), pb.get("max_concurrency")
            band = ((pb.get("predicted") or {}).get("band")) or [p, p]
            steps = abs(ladder_position(ladder, m) - ladder_position(ladder, p))
            out.append(BoundaryPair(v.name, ctx, m, p, band, round(steps, 3)))
    return out


def held_out_cells(predicted: RunData, variant: str) -> set[str]:
    cal = (predicted.boundary.get("calibration") or {}).get(variant) or {}
    return set(cal.get("held_out_cells", []))


def cell_errors(a: RunData, b: RunData, slice_name: str = "ladder") -> list[CellError]:
    out = []
    for v, pv, predicted in _pairs(a, b):
        held = held_out_cells(predicted, v.name)
        for key, cell in sorted(v.cells.items(), key=lambda kv: (kv[1].context, kv[1].concurrency)):
            pc = pv.cells.get(key)
            if cell.slice != slice_name or pc is None:
                continue
            for metric in ("ttft", "itl"):
                if metric in cell.p99 and metric in pc.p99:
                    out.append(CellError(v.name, cell.context, cell.concurrency, metric, cell.p99[metric].value,
                                         pc.p99[metric].value, key in held))
    return out


def _pct(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:+.0%}"


def comparison_table(data: RunData) -> Table | None:
    """Predicted against measured (needs `data.companion`)."""
    if data.companion is None:
        return None
    pairs = {(p.variant, p.context): p for p in boundary_pairs(data, data.companion)}
    errs: dict[tuple[str, int, int], dict[str, CellError]] = {}
    for e in cell_errors(data, data.companion):
        errs.setdefault((e.variant, e.context, e.concurrency), {})[e.metric] = e
    rows = []
    for (name, ctx, c), by in sorted(errs.items()):
        p = pairs.get((name, ctx))
        t, i = by.get("ttft"), by.get("itl")
        rows.append([
            name, str(ctx), str(c),
            f"{fmt_ms(t.measured_ms)} / {fmt_ms(t.predicted_ms)} ({_pct(t.error)})" if t else "-",
            f"{fmt_ms(i.measured_ms)} / {fmt_ms(i.predicted_ms)} ({_pct(i.error)})" if i else "-",
            "held out" if (t or i).held_out else "in sample",  # type: ignore[union-attr]
            "" if p is None else f"{p.measured} / {p.predicted} [{p.band[0]}..{p.band[1]}]"
            + ("" if p.within_one_step else " (off by more than a step)"),
        ])
    return Table(
        "Predicted vs measured",
        ["variant", "context", "concurrency", "p99 TTFT ms measured / predicted", "p99 ITL ms measured / predicted",
         "calibration", "boundary measured / predicted [band]"],
        rows,
        "Relative errors in brackets. Held out: a context or concurrency the calibration's probes never ran.",
    )
