"""The degradation boundary: the highest concurrency at which every SLO holds (R14).

Search: step up the ladder until the first failing step, then bisect between the last
passing concurrency and that first failure until they are adjacent. If the very first
ladder step already fails and it is above 1, the range below it is bisected too.
We stop at the first failure and never look above it for the boundary: a variant that
passes again at a higher concurrency is still unusable at the one that failed. Only when
that failure is uncertain (its interval straddles the SLO) is the next ladder step run,
and only for the range: without a confident miss the range would be open above.

Uncertainty has two parts: the bootstrap interval of each p99 at the cells evaluated,
and a range for the boundary itself: from the highest concurrency whose pass was
*confident* (interval upper bound within the SLO) to one below the lowest concurrency
whose miss was confident. A tight range means the verdict does not hinge on noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tierguard.sweep.cells import CellVerdict


@dataclass
class Boundary:
    """Outcome of one (variant, context) search."""

    context: int
    max_concurrency: int | None  # None: no concurrency met every SLO
    first_failing: int | None  # None: the whole ladder passed (the boundary is at least its top)
    ceiling_reached: bool
    range_low: int | None  # highest confidently passing concurrency (<= max_concurrency)
    range_high: int | None  # one below the lowest confident miss; None: unbounded above
    limited_by: list[str] = field(default_factory=list)  # metrics that missed at first_failing
    points: list[CellVerdict] = field(default_factory=list)  # every cell evaluated, by concurrency

    def at(self, concurrency: int | None) -> CellVerdict | None:
        for p in self.points:
            if p.concurrency == concurrency:
                return p
        return None

    def to_json(self) -> dict:
        best, fail = self.at(self.max_concurrency), self.at(self.first_failing)
        return {
            "context": self.context,
            "max_concurrency": self.max_concurrency,
            "first_failing": self.first_failing,
            "ceiling_reached": self.ceiling_reached,
            "uncertainty": {
                "range": [self.range_low, self.range_high],
                "at_boundary": {m: p.to_json() for m, p in best.p99.items()} if best else None,
                "at_first_failing": {m: p.to_json() for m, p in fail.p99.items()} if fail else None,
            },
            "limited_by": self.limited_by,
            "evaluated": [p.concurrency for p in self.points],
        }


def search(ladder: list[int], evaluate: Callable[[int], CellVerdict], bisect: bool = True) -> Boundary:
    """Find the boundary by calling `evaluate(concurrency)`; each concurrency at most once."""
    seen: dict[int, CellVerdict] = {}

    def run(c: int) -> CellVerdict:
        if c not in seen:
            seen[c] = evaluate(c)
        return seen[c]

    last_pass: int | None = None
    first_fail: int | None = None
    for i, c in enumerate(ladder):
        if run(c).passed:
            last_pass = c
        else:
            first_fail = c
            if not seen[c].confident and i + 1 < len(ladder):
                run(ladder[i + 1])  # bounds the range only: an uncertain miss bounds nothing
            break
    if bisect and first_fail is not None:
        lo, first_fail = _bisect(run, last_pass if last_pass is not None else 0, first_fail)  # 0: nothing passed
        last_pass = lo if lo > 0 else None
    return _boundary(seen, last_pass, first_fail)


def _bisect(run: Callable[[int], CellVerdict], lo: int, hi: int) -> tuple[int, int]:
    """Narrow a passing `lo` and a failing `hi` until they are adjacent."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run(mid).passed:
            lo = mid
        else:
            hi = mid
    return lo, hi


def _boundary(seen: dict[int, CellVerdict], last_pass: int | None, first_fail: int | None) -> Boundary:
    points = [seen[c] for c in sorted(seen)]
    return Boundary(
        context=points[0].context if points else 0,
        max_concurrency=last_pass,
        first_failing=first_fail,
        ceiling_reached=first_fail is None,
        range_low=_confident_low(points, last_pass),
        range_high=_confident_high(points),
        limited_by=list(seen[first_fail].missed) if first_fail is not None else [],
        points=points,
    )


def search_from(
    ladder: list[int],
    evaluate: Callable[[int], CellVerdict],
    predicted: int | None,
    predicted_fail: int | None = None,
    bisect: bool = True,
    always: tuple[int, ...] = (),
) -> Boundary:
    """The boundary measured only around a predicted one (`sweep --predict-first`).

    `predicted` is the highest concurrency predicted to pass (None: none), and
    `predicted_fail` the lowest predicted to fail. The search measures the prediction,
    then moves towards the boundary from it: up (to `predicted_fail`, then the ladder)
    while cells pass, down the ladder while they fail, and bisects the last step as
    `search` does. It assumes what `search` does not: that a cell below a passing one
    would pass too, so the ladder below the prediction is not walked. `always` are
    cells measured first whatever the prediction (the single-request cell); if one of
    them fails the plain search's answer is returned.
    """
    seen: dict[int, CellVerdict] = {}

    def run(c: int) -> CellVerdict:
        if c not in seen:
            seen[c] = evaluate(c)
        return seen[c]

    for c in always:
        if not run(c).passed:
            return search(ladder, run, bisect)
    if not bisect:  # only ladder steps exist then
        below = [c for c in ladder if predicted is not None and c <= predicted]
        predicted, predicted_fail = (below[-1] if below else None), None
    lo, hi = 0, None  # highest pass, lowest fail found
    start = predicted if predicted is not None else ladder[0]
    if run(start).passed:
        lo = start
        ups = ([predicted_fail] if predicted_fail and predicted_fail > start else []) + [c for c in ladder if c > start]
        for c in sorted(set(ups)):
            if run(c).passed:
                lo = c
            else:
                hi = c
                break
    else:
        hi = start
        for c in sorted((c for c in ladder if c < start), reverse=True):
            if run(c).passed:
                lo = c
                break
            hi = c
    if bisect and hi is not None:
        lo, hi = _bisect(run, lo, hi)
    return _boundary(seen, lo if lo > 0 else None, hi)


def _confident_low(points: list[CellVerdict], last_pass: int | None) -> int | None:
    best = None
    for p in points:
        if last_pass is not None and p.concurrency <= last_pass and p.passed and p.confident:
            best = p.concurrency
    return best


def _confident_high(points: list[CellVerdict]) -> int | None:
    for p in points:
        if not p.passed and p.confident:
            return p.concurrency - 1
    return None
