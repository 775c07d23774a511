"""`tierguard predict`: the sweep's boundary search, with every cell simulated.

For each variant: calibrate (or take the cached calibration), build the simulated
engine, then walk exactly what `tierguard sweep` walks: per context the ladder and the
bisection (tierguard/sweep/boundary.py's `search`), then the mixed and prefix slices,
one cell after another on one engine. A simulated cell is judged by the sweep's own
code (`judge`, the SLOs, the bootstrap), and written in the sweep's layout, so
`tierguard report` reads a prediction as it reads a sweep; `state.json` and
`boundary.json` carry a `predicted` section (how each variant was calibrated, the band).

A cell's p99 from one simulated run is as noisy as one measured run's: at one stream
it is the third-largest gap out of a few hundred. The prediction is meant to be the
typical value, so every cell is simulated `REPLICAS` times (each replica a fresh set of
prompts, as another run of the cell would send), and its verdict carries, per metric,
the median replica's p99; it passes when every median is within its limit, and is
`confident` when every replica agreed (the replicas stand in for the bootstrap
interval of a measured cell). The records written are the first replica's.

The band: the whole search runs again with every cost (steps, gaps, transfers) scaled
by 1 - band and 1 + band, the calibration's own drift between probes (calibrate.py);
the boundary's `uncertainty.range` is then [boundary at 1 + band, boundary at 1 - band].
Those two searches simulate one replica a cell: the band is a statement about the
calibration's drift, coarser than a replica's noise.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierguard.bench.runner import mark_phases
from tierguard.bench.stats import summarize
from tierguard.common.errors import TierguardError
from tierguard.engine.config import EngineConfig
from tierguard.kv.spec import KVLayout
from tierguard.model.config import ModelConfig
from tierguard.predict.calibrate import (
    Cache,
    Calibration,
    ProbePlan,
    calibrate_external,
    calibrate_ours,
    digest,
)
from tierguard.predict.driver import Simulation
from tierguard.predict.engines import Policy, classify
from tierguard.predict.media import ROUTES, MediaCost, measure_media
from tierguard.predict.simengine import EngineSpec, SimClock, SimEngine, engine_config_from, model_config_from
from tierguard.predict.workload import cell_workload
from tierguard.sweep.boundary import Boundary, search
from tierguard.sweep.cells import CellSpec, CellVerdict, judge
from tierguard.sweep.matrix import Matrix, Variant
from tierguard.sweep.results import sample_from_record

Log = Callable[[str], None]
NOISE_SEED = 20240601
REPLICAS = 5  # simulated runs per cell (odd: the median is one of them)
REPLICA_STRIDE = 1000  # replica k of repeat r draws the prompts of repeat r + k x stride


@dataclass
class VariantModel:
    """What the simulator needs for one variant."""

    name: str
    spec: EngineSpec
    calibration: Calibration
    media: MediaCost | None = None

    def describe(self) -> dict:
        c = self.calibration
        cfg = self.spec.config
        return {
            "engine": c.kind,
            "calibration": c.fingerprint,
            "band": c.band,
            "probes": c.plan.to_json(),
            "client_ms": c.client.to_json(),
            "cost_ms": c.cost.describe(),
            "conditions": c.conditions,
            "policy": c.policy.to_json() if c.policy else None,
            "engine_config": {"num_blocks": cfg.num_blocks, "block_size": cfg.block_size,
                              "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                              "tiers": cfg.tiers_enabled, "naive_sync_disk": cfg.naive_sync_disk},
            "media_ms": self.media.to_json() if self.media else None,
        }


def generic_spec(policy: Policy, name: str) -> EngineSpec:
    """Our scheduler configured with a black-box engine's limits (engines.py)."""
    bs = max(1, policy.block_size)
    max_len = policy.max_model_len or 1 << 20
    blocks = (policy.kv_tokens // bs) if policy.kv_tokens else (1 << 22)
    cfg = EngineConfig(num_blocks=max(1, blocks), block_size=bs, max_num_seqs=policy.max_num_seqs,
                       max_num_batched_tokens=max(policy.max_num_batched_tokens, policy.max_num_seqs),
                       max_model_len=max_len, enable_prefix_caching=policy.prefix_caching)
    mc = ModelConfig("external", 1 << 20, 1, 1, 1, 1, 1, 1, max_len)
    return EngineSpec(cfg, mc, KVLayout(1, 1, 1, bs, "float32"), name)


def media_key(layout: KVLayout, scratch: Path) -> str:
    """The media timings' cache key: the KV layout, the file system, the machine and the
    routes measured (a new route is measured, never read as missing)."""
    from tierguard.predict.calibrate import machine_id

    return digest({"layout": layout.__dict__, "dev": scratch.stat().st_dev, "machine": machine_id(), "routes": ROUTES})


def media_for(layout: KVLayout, scratch: Path, cache: Cache, log: Log) -> MediaCost:
    key = media_key(layout, scratch)
    cached = cache.get("media", key)
    if cached is not None:
        return MediaCost.from_json(cached["media"])
    log(f"  timing the KV tiers ({layout.block_bytes} B blocks)")
    media = measure_media(layout, scratch)
    cache.put("media", key, {"media": media.to_json()})
    return media


def model_variant(matrix: Matrix, variant: Variant, workdir: Path, cache: Cache, log: Log,
                  plan: ProbePlan | None = None) -> VariantModel:
    kind = classify(variant).kind
    if kind == "tierguard":
        cal, header = calibrate_ours(matrix, variant, workdir, cache, log, plan)
        spec = EngineSpec(engine_config_from(header["engine_config"]), model_config_from(header["model_config"]),
                          KVLayout(**header["kv_layout"]), header.get("model_name", variant.name))
        media = None
        if spec.config.tiers_enabled:
            workdir.mkdir(parents=True, exist_ok=True)
            media = media_for(spec.kv_layout, workdir, cache, log)
        return VariantModel(variant.name, spec, cal, media)
    if variant.command is None:
        raise TierguardError(f"{variant.name}: predicting a running server (base_url) needs its command to "
                             "calibrate on; give `command`")
    cal = calibrate_external(matrix, variant, workdir, cache, log, plan)
    return VariantModel(variant.name, generic_spec(cal.policy or Policy(), variant.name), cal)


def simulation(vm: VariantModel, scale: float, seed: int) -> Simulation:
    clock = SimClock(1000.0)
    rng = np.random.default_rng(seed)
    engine = SimEngine(vm.spec, vm.calibration.cost, vm.media, clock, rng, scale)
    sim = Simulation(engine, clock, vm.calibration.cost, vm.calibration.client, rng, scale)
    sim.warm_up()
    return sim


def workload_fingerprint(wl) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"closed": wl.closed_loop, "c": wl.concurrency}).encode())
    for p, o, off in zip(wl.prompts, wl.output_lens, wl.offsets, strict=True):
        h.update(f"{len(p)}|{o}|{off:.6f}\n".encode())
    return "sim-" + h.hexdigest()[:28]


def simulate_cell(matrix: Matrix, vm: VariantModel, sim: Simulation, spec: CellSpec, out_dir: Path | None,
                  held_out: bool, replicas: int = REPLICAS) -> CellVerdict:
    """Run one cell `replicas` times (each with every repeat), write the first replica's
    bench-layout result, judge each and combine them (`typical`)."""
    vocab = min(32000, vm.spec.model_config.vocab_size)
    unc = matrix.uncertainty.model_copy(update={"bootstrap": 0})  # the replicas are the interval
    verdicts, fps = [], set()
    for k in range(replicas):
        samples = []
        for r in range(matrix.uncertainty.repeats):
            wl = cell_workload(matrix, spec, vocab, repeat=r + k * REPLICA_STRIDE)
            records = sim.run(wl)
            measured = mark_phases(records, wl.config)
            samples += [sample_from_record(rec.to_json()) for rec in measured]
            fp = workload_fingerprint(wl)
            fps.add(fp)
            if out_dir is not None and k == 0:
                from tierguard.bench.results import write_run

                summary = summarize(measured, wl.config.slo)
                summary.update(predicted=True, profile_fingerprint=fp)
                write_run(out_dir / f"r{r}", summary, {"config": wl.config.to_json(), "profile_fingerprint": fp,
                                                       "predicted": True, "held_out": held_out, "model": vm.name},
                          records)
            sim.pause()
        verdicts.append(judge(spec, samples, matrix.slo, unc, fingerprint=fp))
    assert len(fps) == 1
    return typical(verdicts, matrix)


def typical(verdicts: list[CellVerdict], matrix: Matrix) -> CellVerdict:
    """One verdict from a cell's replicas: per metric the median replica's p99, missed
    where that median is over its limit, confident where every replica reached the same
    verdict."""
    limits = matrix.slo.limits()
    first = verdicts[0]
    p99 = {}
    for metric in first.p99:
        ordered = sorted(verdicts, key=lambda v: _value(v, metric))
        p99[metric] = ordered[len(ordered) // 2].p99[metric]
    missed = [m for m in p99 if m in limits and p99[m].value > limits[m]]  # NaN: nothing to judge
    stalls = sorted(v.max_stall_ms for v in verdicts if v.max_stall_ms is not None)
    return CellVerdict(
        slice=first.slice, context=first.context, concurrency=first.concurrency,
        completed=first.completed, failed=first.failed, p99=p99,
        max_stall_ms=stalls[len(stalls) // 2] if stalls else None,
        passed=not missed, missed=missed,
        confident=len({v.passed for v in verdicts}) == 1,
        error=first.error, fingerprint=first.fingerprint,
    )


def _value(v: CellVerdict, metric: str) -> float:
    x = v.p99[metric].value
    return math.inf if math.isnan(x) else x


def ladder_of(matrix: Matrix) -> list[int]:
    ladder = list(matrix.slices.ladder)
    if matrix.slices.single and ladder[0] != 1:
        ladder.insert(0, 1)
    return ladder


def predict_variant(matrix: Matrix, vm: VariantModel, out: Path | None, seed: int = NOISE_SEED,
                    scales: tuple[float, ...] | None = None, extra: dict[int, list[int]] | None = None) -> dict:
    """Boundaries per context at each cost scale (1.0 first; its cells are written), the
    mixed/prefix cells at scale 1, and which cells lie outside the calibration. `extra`:
    per context, ladder cells to simulate beside the search's (e.g. every concurrency a
    measured sweep ran, to compare p99s cell by cell)."""
    band = vm.calibration.band
    scales = scales or (1.0, 1.0 - band, 1.0 + band)
    contexts, concs = vm.calibration.plan.conditions()
    result: dict = {"boundaries": {}, "cells": {}, "bands": {}}
    for k, scale in enumerate(scales):
        sim = simulation(vm, scale, seed)
        write = k == 0 and out is not None

        def run(spec: CellSpec) -> CellVerdict:
            held = spec.context not in contexts or spec.concurrency not in concs
            v = simulate_cell(matrix, vm, sim, spec, (out / spec.key) if write else None, held,  # noqa: B023
                              REPLICAS if k == 0 else 1)  # noqa: B023
            if k == 0:  # noqa: B023
                result["cells"][spec.key] = (v, held)
            return v

        for ctx in matrix.profile.context_lengths:
            b = search(ladder_of(matrix), lambda c, ctx=ctx: run(CellSpec("ladder", ctx, c)),
                       bisect=matrix.slices.bisect)
            result["boundaries"].setdefault(ctx, {})[scale] = b
            for c in (extra or {}).get(ctx, []) if k == 0 else []:
                if CellSpec("ladder", ctx, c).key not in result["cells"]:
                    run(CellSpec("ladder", ctx, c))
        if k == 0:
            mixed, prefix = matrix.slices.mixed, matrix.slices.prefix
            for c in mixed.concurrency if mixed else []:
                run(CellSpec("mixed", mixed.long_len, c))  # type: ignore[union-attr]
            for c in prefix.concurrency if prefix else []:
                run(CellSpec("prefix", prefix.context, c))  # type: ignore[union-attr]
    for ctx, by_scale in result["boundaries"].items():
        vals = [b.max_concurrency or 0 for b in by_scale.values()]
        result["bands"][ctx] = [min(vals) or None, max(vals) or None]
    return result


def predict_matrix(matrix: Matrix, run_dir: Path, cache_dir: Path, log: Log, matrix_text: str | None = None,
                   variants: list[str] | None = None, plan: ProbePlan | None = None,
                   extra: dict[str, dict[int, list[int]]] | None = None) -> dict:
    """Calibrate and simulate every variant; write the sweep layout into `run_dir`."""
    from tierguard.sweep.runner import Sweep, boundary_document

    cache = Cache(cache_dir)
    sweep = Sweep(matrix, run_dir, matrix_text=matrix_text)
    state = sweep.state
    meta = state.data.setdefault("predicted", {"variants": {}})
    for v in matrix.variants:
        if variants is not None and v.name not in variants:
            continue
        vs = state.variant(v.name)
        t0 = time.monotonic()
        try:
            vm = model_variant(matrix, v, run_dir / v.name / "calibration", cache, log, plan)
        except (TierguardError, OSError, ValueError) as exc:
            vs.update(status="failed", error=f"calibration: {exc}")
            state.save()
            log(f"{v.name}: calibration failed: {exc}")
            continue
        t1 = time.monotonic()
        try:
            res = predict_variant(matrix, vm, run_dir / v.name, extra=(extra or {}).get(v.name))
        except (RuntimeError, ValueError, TierguardError) as exc:  # e.g. a workload the engine never finishes
            vs.update(status="failed", error=f"simulation: {exc}")
            state.save()
            log(f"{v.name}: simulation failed: {exc}")
            continue
        for key, (verdict, _held) in res["cells"].items():
            state.data["cells"].setdefault(v.name, {})[key] = verdict.to_json()
        for ctx, by_scale in res["boundaries"].items():
            b: Boundary = by_scale[1.0]
            doc = b.to_json()
            lo, hi = res["bands"][ctx]
            doc["uncertainty"]["range"] = [lo, hi]
            doc["predicted"] = {"band": [lo, hi], "scales": {f"{s:g}": x.max_concurrency for s, x in by_scale.items()}}
            state.data["boundaries"].setdefault(v.name, {})[str(ctx)] = doc
            log(f"{v.name}: context {ctx} -> predicted boundary {b.max_concurrency} (band {lo}..{hi})")
        held = sorted(k for k, (_v, h) in res["cells"].items() if h)
        meta["variants"][v.name] = {**vm.describe(), "held_out_cells": held,
                                    "calibrate_s": round(t1 - t0, 1), "simulate_s": round(time.monotonic() - t1, 1)}
        vs.update(status="done", error=None, engine={"model": vm.spec.model_name, "version": "simulated"})
        state.save()
    doc = boundary_document(matrix, state)
    (run_dir / "boundary.json").write_text(json.dumps(doc, indent=1))
    return doc
