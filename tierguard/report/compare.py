"""Compare two measured boundaries the way their uncertainty allows.

A boundary (sweep/boundary.py) comes with a range: from the highest concurrency whose
pass was confident to one below the lowest concurrency whose miss was confident. Two
variants are measurably apart only when those ranges do not overlap; otherwise the
measured order may be noise, and a recommendation must not rest on it.

The recommender states every comparison it makes as a `Claim`, so a test can check
that no sentence calls A better than B (or puts A before B) while A's measured
boundary is below B's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tierguard.report.load import VariantData

Relation = Literal["above", "below", "same"]


@dataclass(frozen=True)
class Measured:
    """One variant's boundary at one context: the point and its range."""

    name: str
    best: int  # highest passing concurrency; 0 when none passed
    low: int  # highest confident pass (0: none)
    high: float  # one below the lowest confident miss; inf when no miss was confident
    ceiling: bool  # the ladder's top still passed: the true boundary may be higher

    @classmethod
    def of(cls, v: VariantData, ctx: int) -> Measured | None:
        b = v.boundaries.get(ctx)
        if not b:
            return None
        best = b.get("max_concurrency") or 0
        lo, hi = (b.get("uncertainty") or {}).get("range") or [None, None]
        ceiling = bool(b.get("ceiling_reached"))
        low = min(lo if lo is not None else 0, best)
        high = math.inf if hi is None or ceiling else max(hi, best)
        return cls(v.name, best, low, high, ceiling)

    def interval(self) -> str:
        hi = "open" if math.isinf(self.high) else str(int(self.high))
        return f"{self.best} [{self.low}, {hi}]"


def relation(a: Measured, b: Measured) -> Relation:
    """Where a's boundary lies against b's: measurably above, below, or not apart."""
    if a.low > b.high:
        return "above"
    if b.low > a.high:
        return "below"
    return "same"


@dataclass(frozen=True)
class Claim:
    """A comparison a sentence makes: `better` A's boundary is above B's; `before` A is
    recommended before B."""

    kind: Literal["better", "before"]
    a: str
    b: str
    context: int


@dataclass
class Advice:
    text: str
    claims: tuple[Claim, ...] = ()
