"""Typed stats: plain dataclasses whose fields say whether they are counters or gauges.

Why: a `dict[str, float]` built in several places leaves its readers looking values up
by string, and a typo is a silent zero. Each layer returns a dataclass instead; a field
declared with `counter()` or `gauge()` carries its kind and help text, and `samples()`
walks a tree of them into named values. The metrics layer (tierguard/serve/metrics.py)
exports counters as Prometheus counters and gauges as gauges; tests and benchmarks read
`flat()`, whose keys are the metric names without the `tierguard:engine_` prefix.

Naming: a leaf's name is its group prefix + field name (or the field's `name` template);
`group(prefix)` nests a dataclass, or a `dict[str, dataclass]` with "{key}" in the
prefix (one group per medium or route); a dict of numbers needs a `name` template with
"{key}".
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from tierguard.common.percentile import percentile

COUNTER = "counter"
GAUGE = "gauge"


def counter(doc: str, name: str | None = None, default: Any = 0) -> Any:
    """A monotonically increasing total (a dict of totals when `name` has "{key}")."""
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"kind": COUNTER, "doc": doc, "name": name})
    return field(default=default, metadata={"kind": COUNTER, "doc": doc, "name": name})


def gauge(doc: str, name: str | None = None, default: Any = 0.0) -> Any:
    """A value that goes up and down (bools export as 0/1)."""
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"kind": GAUGE, "doc": doc, "name": name})
    return field(default=default, metadata={"kind": GAUGE, "doc": doc, "name": name})


def group(prefix: str = "", factory: Any = None) -> Any:
    """A nested stats dataclass (or a dict of them, keyed into the prefix by "{key}")."""
    meta = {"kind": "group", "prefix": prefix}
    return field(default_factory=factory or dict, metadata=meta)


@dataclass(frozen=True)
class Sample:
    name: str
    kind: str  # COUNTER or GAUGE
    doc: str
    value: float


def samples(obj: Any, prefix: str = "") -> Iterator[Sample]:
    """Every counter and gauge in a stats tree, in field order. Unmarked fields are skipped
    (e.g. histograms, which the metrics layer exports on their own)."""
    if obj is None:
        return
    for f in fields(obj):
        kind = f.metadata.get("kind")
        if kind is None:
            continue
        value = getattr(obj, f.name)
        if kind == "group":
            items = value.items() if isinstance(value, dict) else [("", value)]
            for key, sub in items:
                if is_dataclass(sub):
                    yield from samples(sub, prefix + f.metadata["prefix"].format(key=key))
            continue
        doc = f.metadata["doc"]
        template = f.metadata.get("name") or f.name
        if isinstance(value, dict):
            for key, v in value.items():
                yield Sample(prefix + template.format(key=key), kind, doc, float(v))
        else:
            yield Sample(prefix + template, kind, doc, float(value))


def flat(*objs: Any, prefix: str = "") -> dict[str, float]:
    """{name: value} of one or more stats trees (None is skipped)."""
    out: dict[str, float] = {}
    for obj in objs:
        out.update((s.name, s.value) for s in samples(obj, prefix))
    return out


def quantile_ms(latencies_s: list[float], q: float) -> float:
    """The q-quantile (q in 0..1) of latencies in seconds, in ms (0.0 when empty), by the
    one percentile definition (common/percentile.py)."""
    return 1000 * percentile(latencies_s, 100 * q, empty=0.0)  # type: ignore[operator]
