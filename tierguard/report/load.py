"""Load everything a report shows from a sweep's run directory.

The report never re-runs anything: verdicts and boundaries come from state.json, the
distributions from each cell's bench results, counters from the engine's /metrics
scrape after each cell.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tierguard.common.errors import TierguardError
from tierguard.sweep.cells import CellVerdict
from tierguard.sweep.matrix import Matrix, load_matrix
from tierguard.sweep.results import load_samples, read_json
from tierguard.sweep.runner import State, boundary_document, matrix_digest
from tierguard.sweep.stats import RequestSample

# Counter names worth showing: tiers, cache, queue, preemption (R13's three signals).
COUNTER_WORDS = (
    "kv",
    "tier",
    "cache",
    "hit",
    "miss",
    "preempt",
    "queue",
    "waiting",
    "running",
    "swap",
    "offload",
    "evict",
    "disk",
    "host",
    "recompute",
    "reject",
)


@dataclass
class VariantData:
    name: str
    status: str
    error: str | None
    description: str
    tags: list[str]
    engine: dict
    cells: dict[str, CellVerdict]  # key -> verdict
    boundaries: dict[int, dict]  # context -> boundary json
    counters: list[tuple[str, str, float]] = field(default_factory=list)  # (name, labels, value)

    def ladder(self, context: int) -> list[CellVerdict]:
        pts = [c for c in self.cells.values() if c.slice == "ladder" and c.context == context]
        return sorted(pts, key=lambda c: c.concurrency)


@dataclass
class RunData:
    run_dir: Path
    matrix: Matrix
    variants: list[VariantData]
    environment: dict
    boundary: dict
    predicted: bool = False  # simulated by `tierguard predict`, not measured
    # The other side of a prediction: the measured sweep of a predicted run, or the
    # prediction of a measured one (RUN_DIR/predicted); drawn on the same plots.
    companion: RunData | None = None
    # (variant, cell key) -> samples: tables, plots and recommendations ask for the same
    # cells, and each read parses every repeat's requests.jsonl.
    _samples: dict[tuple[str, str], list[RequestSample]] = field(default_factory=dict, repr=False)

    def samples(self, variant: str, key: str) -> list[RequestSample]:
        if (variant, key) not in self._samples:
            cell_dir = self.run_dir / variant / key
            out: list[RequestSample] = []
            for r in sorted(cell_dir.glob("r*")):
                if r.is_dir():
                    out.extend(load_samples(r))
            self._samples[variant, key] = out
        return self._samples[variant, key]


def parse_counters(text: str) -> list[tuple[str, str, float]]:
    """Interesting samples of a Prometheus text exposition: (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: list[tuple[str, str, float]] = []
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError):
        return out
    for fam in families:
        for s in fam.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            if any(w in s.name.lower() for w in COUNTER_WORDS):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out.append((s.name, labels, float(s.value)))
    return out


def _last_metrics(vdir: Path) -> list[tuple[str, str, float]]:
    """The sweep's own /metrics scrape after the latest cell; else the bench's last scrape."""
    scrapes = sorted(vdir.glob("*/metrics.prom"), key=lambda p: p.stat().st_mtime)
    if scrapes:
        return parse_counters(scrapes[-1].read_text(errors="replace"))
    series = sorted(vdir.glob("*/r*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    if not series:
        return []
    lines = [ln for ln in series[-1].read_text(errors="replace").splitlines() if ln.strip()]
    try:
        last = json.loads(lines[-1]).get("samples", {}) if lines else {}
    except (json.JSONDecodeError, AttributeError):
        return []
    return [
        (k, "", float(v))
        for k, v in sorted(last.items())
        if isinstance(v, (int, float)) and any(w in k.lower() for w in COUNTER_WORDS)
    ]


def load_run(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    if not (run_dir / "matrix.yaml").is_file() or not (run_dir / "state.json").is_file():
        raise TierguardError(
            f"{run_dir} is not a sweep run directory (no matrix.yaml/state.json); "
            "run `tierguard sweep MATRIX.yaml --run-dir DIR` first"
        )
    matrix = load_matrix(run_dir / "matrix.yaml")
    state = State(run_dir / "state.json", matrix_digest(matrix))
    variants = []
    for v in matrix.variants:
        vs = state.data["variants"].get(v.name, {"status": "pending"})
        cells = {k: CellVerdict.from_json(d) for k, d in state.data["cells"].get(v.name, {}).items()}
        bounds = {int(c): b for c, b in state.data["boundaries"].get(v.name, {}).items() if b}
        engine = read_json(run_dir / v.name / "engine.json") or {}
        variants.append(
            VariantData(
                name=v.name,
                status=vs.get("status", "pending"),
                error=vs.get("error"),
                description=v.description,
                tags=list(v.tags),
                engine=engine,
                cells=cells,
                boundaries=bounds,
                counters=_last_metrics(run_dir / v.name),
            )
        )
    _check_profiles(run_dir, variants)
    env = read_json(run_dir / "environment.json") or {}
    return RunData(run_dir, matrix, variants, env, boundary_document(matrix, state), bool(state.data.get("predicted")))


def with_companion(data: RunData, other: Path | None = None) -> RunData:
    """Attach `other` (or RUN_DIR/predicted, when it holds a prediction) for side-by-side
    plots and the predicted-vs-measured table; only one side may be predicted."""
    path = other if other is not None else data.run_dir / "predicted"
    if other is None and not (path / "state.json").is_file():
        return data
    comp = load_run(path)
    if comp.predicted == data.predicted:
        raise TierguardError(
            f"{path} is {'a prediction' if comp.predicted else 'a measured sweep'} like {data.run_dir}; "
            "compare a prediction with a measured sweep"
        )
    if comp.matrix.slo != data.matrix.slo or comp.matrix.profile != data.matrix.profile:
        raise TierguardError(f"{path} and {data.run_dir} differ in their profile or SLOs; they do not compare")
    data.companion = comp
    return data


def _check_profiles(run_dir: Path, variants: list[VariantData]) -> None:
    """Refuse to put side by side cells whose workload fingerprints differ (R10)."""
    from tierguard.sweep.fingerprints import compare_result_dirs

    seen: dict[str, tuple[str, str]] = {}  # cell key -> (variant, fingerprint)
    for v in variants:
        for key, cell in v.cells.items():
            if not cell.fingerprint:
                continue
            if key in seen and seen[key][1] != cell.fingerprint:
                other = seen[key][0]
                compare_result_dirs(run_dir / other / key / "r0", run_dir / v.name / key / "r0")
                raise TierguardError(
                    f"refusing to compare {other} with {v.name} at {key}: their workload fingerprints differ"
                )
            seen.setdefault(key, (v.name, cell.fingerprint))


def write_boundary_json(data: RunData, path: Path) -> None:
    path.write_text(json.dumps(data.boundary, indent=1))
