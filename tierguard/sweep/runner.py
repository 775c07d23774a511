"""The resumable sweep: variants x context lengths x slices, boundary search per context.

Run directory layout (all of it is what `tierguard report` reads):

    RUN_DIR/matrix.yaml            the matrix, as given
    RUN_DIR/state.json             progress: variant status, every cell's verdict, boundaries
    RUN_DIR/environment.json       host, Python, topology of the machine that ran the sweep
    RUN_DIR/boundary.json          the outcome (R14), rewritten after every context
    RUN_DIR/timeline.jsonl         one line per event (engine start/ready/stop, cell start/done)
                                   with its wall-clock time: where a sweep's minutes went
    RUN_DIR/<variant>/engine.log   engine stdout+stderr; engine.json: version, command, exit
    RUN_DIR/<variant>/<cell>/r<i>/ one bench result directory per repeat (+ bench.log)
    RUN_DIR/<variant>/<cell>/metrics.prom   the engine's /metrics after the cell

Resuming: state.json is rewritten atomically after every cell, so a restart replays the
boundary search from recorded verdicts and only runs the cells that are missing; the
engine of a variant is started only when one of its cells still needs to run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tierguard.common.errors import TierguardError
from tierguard.sweep.benchcall import BenchOutcome, bench_argv, cell_requests, run_bench
from tierguard.sweep.boundary import Boundary, search, search_from
from tierguard.sweep.cells import CellSpec, CellVerdict, judge_dirs
from tierguard.sweep.environment import capture_environment
from tierguard.sweep.fingerprints import check_same_profile
from tierguard.sweep.lifecycle import Engine, EngineStartError, http_get
from tierguard.sweep.matrix import Matrix, Variant

Event = Callable[..., None]  # on_event(kind: str, **details)
# run_bench(argv, log_path, timeout_s) -> BenchOutcome; replaceable so tests can stand in for it.
BenchFn = Callable[[list[str], Path, float], BenchOutcome]


class EngineDied(Exception):
    pass


def matrix_digest(matrix: Matrix) -> str:
    return hashlib.sha256(json.dumps(matrix.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[
        :16
    ]


class State:
    """state.json: the single source of truth for what has been done."""

    def __init__(self, path: Path, digest: str) -> None:
        self.path = path
        self.data: dict = {"matrix_digest": digest, "variants": {}, "cells": {}, "boundaries": {}}
        if path.is_file():
            try:
                old = json.loads(path.read_text())
            except json.JSONDecodeError:
                raise TierguardError(f"{path} is corrupt; remove it or use a new run directory") from None
            if old.get("matrix_digest") != digest:
                raise TierguardError(
                    f"{path.parent} holds a sweep of a different matrix; "
                    "use a new --run-dir (or --fresh to discard it)"
                )
            self.data = old

    def variant(self, name: str) -> dict:
        return self.data["variants"].setdefault(name, {"status": "pending"})

    def cell(self, variant: str, key: str) -> CellVerdict | None:
        d = self.data["cells"].get(variant, {}).get(key)
        return CellVerdict.from_json(d) if d else None

    def put_cell(self, variant: str, verdict: CellVerdict) -> None:
        self.data["cells"].setdefault(variant, {})[verdict.key] = verdict.to_json()
        self.save()

    def put_boundary(self, variant: str, b: Boundary) -> None:
        self.data["boundaries"].setdefault(variant, {})[str(b.context)] = b.to_json()
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)  # atomic: a crash leaves the old or the new file, never half


def boundary_document(matrix: Matrix, state: State) -> dict:
    """boundary.json: per variant and context, the highest concurrency meeting every SLO."""
    out: dict = {"matrix": matrix.name, "slo": matrix.slo.model_dump(exclude_none=True), "variants": {}}
    for v in matrix.variants:
        vs = state.data["variants"].get(v.name, {"status": "pending"})
        per_ctx = state.data["boundaries"].get(v.name, {})
        out["variants"][v.name] = {
            "status": vs.get("status"),
            "error": vs.get("error"),
            "contexts": {str(c): per_ctx.get(str(c)) for c in matrix.profile.context_lengths},
        }
    if state.data.get("predicted"):  # `tierguard predict`: simulated cells, how each variant was calibrated
        out["predicted"] = True
        out["calibration"] = state.data["predicted"].get("variants", {})
    return out


class Sweep:
    def __init__(
        self,
        matrix: Matrix,
        run_dir: Path,
        on_event: Event | None = None,
        matrix_text: str | None = None,
        bench: BenchFn = run_bench,
        predicted: dict[str, dict[int, tuple[int | None, int | None]]] | None = None,
    ) -> None:
        self.matrix = matrix
        self.bench = bench
        # `sweep --predict-first`: variant -> context -> (predicted boundary, first failing);
        # the search starts there and measures only around it (boundary.py's search_from).
        self.predicted = predicted or {}
        self.run_dir = run_dir
        self._on_event = on_event
        run_dir.mkdir(parents=True, exist_ok=True)
        self.state = State(run_dir / "state.json", matrix_digest(matrix))
        mpath = run_dir / "matrix.yaml"
        if not mpath.exists():
            mpath.write_text(matrix_text or yaml.safe_dump(matrix.model_dump(mode="json"), sort_keys=False))
        if not (run_dir / "environment.json").exists():
            (run_dir / "environment.json").write_text(json.dumps(capture_environment(), indent=1))

    def emit(self, kind: str, **kw) -> None:
        """Pass the event on and append it to timeline.jsonl (time, kind, variant, cell)."""
        line: dict = {"t": round(time.time(), 3), "kind": kind, "variant": kw.get("variant")}
        cell = kw.get("spec") or kw.get("verdict")
        if cell is not None:
            line["cell"] = cell.key
        with open(self.run_dir / "timeline.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if self._on_event is not None:
            self._on_event(kind, **kw)

    def run(self) -> dict:
        for variant in self.matrix.variants:
            vs = self.state.variant(variant.name)
            if vs["status"] in ("done", "failed"):
                self.emit("variant_skipped", variant=variant.name, status=vs["status"])
                continue
            self._run_variant(variant, vs)
        doc = boundary_document(self.matrix, self.state)
        (self.run_dir / "boundary.json").write_text(json.dumps(doc, indent=1))
        return doc

    def _run_variant(self, variant: Variant, vs: dict) -> None:
        engine = Engine(variant, self.run_dir / variant.name)
        started = False

        def ensure_engine() -> Engine:
            nonlocal started
            if not started:
                self.emit("engine_starting", variant=variant.name)
                engine.start(self.matrix.profile)
                started = True
                self.emit("engine_ready", variant=variant.name, info=engine.info)
            elif not engine.alive():
                raise EngineDied(f"engine exited with code {engine.proc.returncode} during the sweep")  # type: ignore[union-attr]
            return engine

        vs.update(status="running", error=None)
        self.state.save()
        try:
            for ctx in self.matrix.profile.context_lengths:
                evaluate = lambda c, ctx=ctx: self._cell(variant, CellSpec("ladder", ctx, c), ensure_engine)  # noqa: E731
                guess = self.predicted.get(variant.name, {}).get(ctx)
                if guess is not None:
                    always = (1,) if self.matrix.slices.single else ()  # R9's single-request cell
                    b = search_from(self._ladder(), evaluate, guess[0], guess[1], self.matrix.slices.bisect, always)
                else:
                    b = search(self._ladder(), evaluate, bisect=self.matrix.slices.bisect)
                self.state.put_boundary(variant.name, b)
                self.emit("boundary", variant=variant.name, boundary=b)
            mixed = self.matrix.slices.mixed
            for c in mixed.concurrency if mixed else []:
                self._cell(variant, CellSpec("mixed", mixed.long_len, c), ensure_engine)  # type: ignore[union-attr]
            prefix = self.matrix.slices.prefix
            for c in prefix.concurrency if prefix else []:
                self._cell(variant, CellSpec("prefix", prefix.context, c), ensure_engine)  # type: ignore[union-attr]
            vs.update(status="done")
        except (EngineStartError, EngineDied) as exc:
            vs.update(status="failed", error=str(exc))
            self.emit("variant_failed", variant=variant.name, error=str(exc))
        finally:
            engine.stop()
            self.emit("engine_stopped", variant=variant.name)
            if engine.info:
                vs["engine"] = {k: engine.info.get(k) for k in ("version", "model", "exit_code", "stop")}
            self.state.save()

    def _ladder(self) -> list[int]:
        ladder = list(self.matrix.slices.ladder)
        if self.matrix.slices.single and ladder[0] != 1:
            ladder.insert(0, 1)  # R9's single-request slice is the first step of every ladder
        return ladder

    def _cell(self, variant: Variant, spec: CellSpec, ensure_engine: Callable[[], Engine]) -> CellVerdict:
        cached = self.state.cell(variant.name, spec.key)
        if cached is not None:
            self.emit("cell_cached", variant=variant.name, verdict=cached)
            return cached
        engine = ensure_engine()
        self.emit("cell_start", variant=variant.name, spec=spec)
        cell_dir = self.run_dir / variant.name / spec.key
        dirs, errors = [], []
        n = cell_requests(self.matrix, spec)
        timeout = self.matrix.profile.timeout_s * max(2, n // spec.concurrency + 2)
        for r in range(self.matrix.uncertainty.repeats):
            out = cell_dir / f"r{r}"
            argv = bench_argv(self.matrix, spec, engine.base_url, engine.model, out, repeat=r)
            outcome = self.bench(argv, cell_dir / f"bench-r{r}.log", timeout)
            dirs.append(out)
            if outcome.error:
                errors.append(outcome.error)
        status, text = http_get(f"{engine.base_url}/metrics", timeout=5.0)
        if status == 200 and text:
            (cell_dir / "metrics.prom").write_text(text)
        verdict = judge_dirs(
            spec, dirs, self.matrix.slo, self.matrix.uncertainty, error="; ".join(errors) if errors else None
        )
        check_same_profile(
            self.run_dir, self.matrix, variant.name, spec.key, verdict.fingerprint, self.state.data
        )
        self.state.put_cell(variant.name, verdict)
        self.emit("cell_done", variant=variant.name, verdict=verdict)
        if not engine.alive():
            raise EngineDied(f"engine exited with code {engine.proc.returncode} during cell {spec.key}")  # type: ignore[union-attr]
        return verdict
