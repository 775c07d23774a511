"""One cell of a sweep: a bench run at one (slice, context, concurrency), and its verdict.

A cell's verdict depends only on the per-request samples in its result directory and
the SLOs, so it can be recomputed from disk at any time (the report does exactly that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tierguard.sweep.matrix import SLO, Uncertainty
from tierguard.sweep.results import load_samples, read_json
from tierguard.sweep.stats import METRICS, P99, RequestSample, p99_with_interval


@dataclass(frozen=True)
class CellSpec:
    """Where a cell sits in the matrix; `key` names its result directory."""

    slice: str  # "ladder" (includes the single-request cell at concurrency 1), "mixed" or "prefix"
    context: int
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.slice}-ctx{self.context}-c{self.concurrency}"


@dataclass
class CellVerdict:
    """Did this cell meet every SLO, and how sure are we."""

    slice: str
    context: int
    concurrency: int
    completed: int
    failed: int  # failed + rejected + timed out: all count as SLO misses
    p99: dict[str, P99]
    max_stall_ms: float | None
    passed: bool
    missed: list[str] = field(default_factory=list)
    confident: bool = True  # every metric's interval lies on one side of its limit
    error: str | None = None
    fingerprint: str | None = None

    @property
    def key(self) -> str:
        return CellSpec(self.slice, self.context, self.concurrency).key

    def to_json(self) -> dict:
        return {
            "slice": self.slice,
            "context": self.context,
            "concurrency": self.concurrency,
            "completed": self.completed,
            "failed": self.failed,
            "p99": {m: p.to_json() for m, p in self.p99.items()},
            "max_stall_ms": self.max_stall_ms,
            "passed": self.passed,
            "missed": self.missed,
            "confident": self.confident,
            "error": self.error,
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_json(cls, d: dict) -> CellVerdict:
        return cls(
            slice=d["slice"],
            context=d["context"],
            concurrency=d["concurrency"],
            completed=d["completed"],
            failed=d["failed"],
            p99={m: P99.from_json(p) for m, p in d["p99"].items()},
            max_stall_ms=d.get("max_stall_ms"),
            passed=d["passed"],
            missed=list(d.get("missed", [])),
            confident=d.get("confident", True),
            error=d.get("error"),
            fingerprint=d.get("fingerprint"),
        )


def judge(
    spec: CellSpec,
    samples: list[RequestSample],
    slo: SLO,
    unc: Uncertainty,
    fingerprint: str | None = None,
    error: str | None = None,
) -> CellVerdict:
    """Compare each p99 with its limit. No samples at all is a miss of every SLO."""
    limits = slo.limits()
    p99: dict[str, P99] = {}
    missed: list[str] = []
    confident = True
    for metric in METRICS:
        # Intervals only where a limit is judged; other p99s are shown, not decided on.
        boot = unc.bootstrap if metric in limits else 0
        est = p99_with_interval(samples, metric, boot, unc.confidence) if samples else P99(math.inf)
        p99[metric] = est
        if metric not in limits:
            continue
        limit = limits[metric]
        value = est.value
        if math.isnan(value):
            continue  # e.g. ITL when every answer had one token: nothing to judge
        if value > limit:
            missed.append(metric)
            if est.low is not None and est.low <= limit:
                confident = False
        elif est.high is not None and est.high > limit:
            confident = False
    if not samples:
        missed = sorted(limits, key=list(METRICS).index)
    failed = sum(1 for s in samples if not s.ok)
    stalls = [s.max_stall_ms for s in samples if s.ok and math.isfinite(s.max_stall_ms)]
    return CellVerdict(
        slice=spec.slice,
        context=spec.context,
        concurrency=spec.concurrency,
        completed=len(samples) - failed,
        failed=failed,
        p99=p99,
        max_stall_ms=max(stalls) if stalls else None,
        passed=not missed,
        missed=missed,
        confident=confident,
        error=error,
        fingerprint=fingerprint,
    )


def judge_dirs(
    spec: CellSpec, dirs: list[Path], slo: SLO, unc: Uncertainty, error: str | None = None
) -> CellVerdict:
    """Pool the samples of the repeats of one cell and judge them together."""
    samples: list[RequestSample] = []
    fps: set[str] = set()
    for d in dirs:
        samples.extend(load_samples(d))
        fp = read_fingerprint(d)
        if fp:
            fps.add(fp)
    return judge(spec, samples, slo, unc, fingerprint=sorted(fps)[0] if len(fps) == 1 else None, error=error)


def read_fingerprint(result_dir: Path) -> str | None:
    data = read_json(result_dir / "run.json")
    if data is None:
        return None
    fp = data.get("fingerprint") or data.get("profile_fingerprint")
    if isinstance(fp, dict):
        fp = fp.get("sha256") or fp.get("hash") or fp.get("value")
    return str(fp) if fp else None
