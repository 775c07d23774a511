"""Fit the reserve coefficients of each vLLM version band from public startup logs.

The rows live in data/vllm_logs.json (source, settings, logged numbers, quoted lines).
Each logged quantity is fitted on its own, from the rows that log it:

- activation peak = max(forward_scale x forward bytes, bytes_per_logit x logits) + offset,
  per band. Rows are split by which term explains them (iterated from a start where
  the sampler term is taken from rows the forward pass cannot explain); the sampler
  rows get a least-squares line (through the origin if the intercept comes out
  negative), the forward rows a median ratio.
- non-torch memory: the median of the band's single-GPU rows and of its tensor-parallel
  rows; a band without such rows borrows the nearest older band's, else all bands'.
- CUDA-graph estimate: a least-squares line in decoder layers per GPU over all rows
  that log vLLM's own estimate (only 0.19 does).

A band without activation rows (0.21: none logged yet) uses the
nearest older band's activation fit. Leave-one-out calls `fit_band` with one row held
out; the planner calls `fitted`, which uses every row not marked `exclude`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np

from tierguard.common.units import GIB
from tierguard.plan.catalogue import load_model
from tierguard.plan.dtypes import weight_format
from tierguard.plan.reserves import BANDS, Features, Reserves, engine_rules, features


@dataclass(frozen=True)
class LogRow:
    """One startup log, as stored; `raw` keeps every field for the report."""

    id: str
    band: str
    raw: dict

    @property
    def logged(self) -> dict:
        return self.raw["logged"]

    @property
    def excluded(self) -> bool:
        return bool(self.raw.get("exclude"))


def load_rows() -> list[LogRow]:
    text = resources.files("tierguard.plan").joinpath("data/vllm_logs.json").read_text(encoding="utf-8")
    return [LogRow(r["id"], engine_rules(r["vllm_version"]).band.name, r) for r in json.loads(text)["rows"]]


def activation_bytes(weights_dtype: str) -> int:
    """Activations run in the weights' dtype when that is a float type (fp32 doubles them)."""
    return 4 if weights_dtype.strip().lower() in ("fp32", "float32") else 2


def row_features(row: LogRow) -> Features:
    r = row.raw
    spec = load_model(r["model"])
    wfmt = weight_format(r["weights_dtype"], spec.torch_dtype, spec.quantization)
    return features(
        spec, r["tp"], r["pp"], r["max_num_batched_tokens"], r["max_num_seqs"], activation_bytes(wfmt.name)
    )


def _lstsq(x: list[float], y: list[float]) -> tuple[float, float]:
    """y = a x + b; through the origin when b would be negative."""
    xa, ya = np.asarray(x, float), np.asarray(y, float)
    if len(xa) >= 2 and xa.max() > 1.2 * xa.min():
        a, b = np.linalg.lstsq(np.vstack([xa, np.ones_like(xa)]).T, ya, rcond=None)[0]
        if b >= 0:
            return float(a), float(b)
    return float((xa @ ya) / (xa @ xa)), 0.0


def _fit_activation(samples: list[tuple[Features, float]]) -> tuple[float, float, float]:
    """(forward_scale, bytes_per_logit, offset) from (features, logged bytes) pairs."""
    unexplained = [act / f.logits for f, act in samples if f.forward_bytes < 0.5 * act]
    per_logit = (
        statistics.median(unexplained) if unexplained else statistics.median(a / f.logits for f, a in samples)
    )
    scale, offset = 1.0, 0.0
    for _ in range(5):
        smp = [(f, a) for f, a in samples if per_logit * f.logits >= scale * f.forward_bytes]
        fwd = [(f, a) for f, a in samples if per_logit * f.logits < scale * f.forward_bytes]
        if smp:
            per_logit, offset = _lstsq([f.logits for f, _ in smp], [a for _, a in smp])
        if fwd:
            scale = statistics.median((a - offset) / f.forward_bytes for f, a in fwd)
    return scale, per_logit, offset


def _older(band: str) -> list[str]:
    names = [b.name for b in BANDS]
    return list(reversed(names[: names.index(band)]))


def fit_band(band: str, rows: list[LogRow]) -> Reserves:
    """Coefficients for `band` from `rows` (excluded rows are ignored)."""
    rows = [r for r in rows if not r.excluded]
    feats = {r.id: row_features(r) for r in rows}
    gib = GIB

    # Pipeline-parallel logs come from the first stage, which runs no sampler, while the
    # last stage sets the KV size: their activation and non-torch lines are not fitted.
    flat = [r for r in rows if r.raw["pp"] == 1]

    def act_samples(b: str) -> list[tuple[Features, float]]:
        return [
            (feats[r.id], r.logged["activation_gib"] * gib)
            for r in flat
            if r.band == b and r.logged.get("activation_gib") is not None
        ]

    source, samples = band, act_samples(band)
    for older in _older(band):
        if samples:
            break
        source, samples = older, act_samples(older)
    scale, per_logit, offset = _fit_activation(samples) if samples else (1.0, 14.5, 0.0)

    def nt(multi: bool) -> list[float]:
        """This band's rows, else the nearest older band's, else every band's."""
        found = [
            (r.band, r.logged["non_torch_gib"] * gib)
            for r in flat
            if r.logged.get("non_torch_gib") is not None and (r.raw["tp"] > 1) == multi
        ]
        for b in [band, *_older(band)]:
            if any(rb == b for rb, _ in found):
                return [v for rb, v in found if rb == b]
        return [v for _, v in found]

    single, multi = nt(False), nt(True)
    graph = [
        (feats[r.id].graph_layers, r.logged["cuda_graph_estimate_gib"] * gib)
        for r in rows
        if r.logged.get("cuda_graph_estimate_gib") is not None
    ]
    g_per_layer, g_offset = _lstsq([x for x, _ in graph], [y for _, y in graph]) if graph else (0.0, 0.0)
    return Reserves(
        band=band,
        forward_scale=scale,
        bytes_per_logit=per_logit,
        activation_offset=offset,
        non_torch_single=statistics.median(single) if single else 0.25 * gib,
        non_torch_tp=statistics.median(multi) if multi else 2.0 * gib,
        graph_offset=g_offset,
        graph_bytes_per_layer=g_per_layer,
        rows={
            "activation": len(samples),
            "activation_band": int(source == band),
            "non_torch_single": len(single),
            "non_torch_tp": len(multi),
            "cuda_graph": len(graph),
        },
    )


@cache
def fitted(band: str) -> Reserves:
    """The planner's coefficients: fitted on every usable row."""
    return fit_band(band, load_rows())
