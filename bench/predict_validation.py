"""`tierguard predict` against `tierguard sweep` on runs no part of the fit saw.

For each suite (a matrix): predict it (calibration probes, cached in OUT/cache, then
simulation), sweep it for real, predict again at every concurrency the sweep measured
(calibrations from the cache), and compare:

  - per variant and context, the predicted boundary against the measured one: within
    one ladder step or not;
  - per measured cell, the relative error of the predicted p99 TTFT and p99 ITL, split
    into in-sample cells (a context and a concurrency the calibration probed) and held
    out ones (the suites add a context the probes never ran, and the ladder goes above
    the probes' top concurrency);
  - the naive baseline's collapse: predicted and measured below the small pool;
  - with --repeat-sweep, the same sweep run again: its cells against the first's (how
    far two measurements of one cell are apart) and the prediction against it.

Then `sweep --predict-first` against a plain sweep of the demo matrix: wall time and both
boundary tables. Suites:

    tiny       the demo matrix (tierguard serve, built-in tiny model), contexts 1024 + 768
    smollm2    the demo's six variants on SmolLM2-135M (pools resized), contexts 256 + 192
    llamacpp   llama-cpp-python's server on SmolLM2's GGUF (needs an interpreter with
               llama_cpp.server: --llama-python, TIERGUARD_LLAMA_PYTHON or .venv-llamacpp)
    vllm       vLLM's CPU server on SmolLM2 (--vllm-python, default .venv-vllm)

Prints one JSON object ("valid", per suite the tables and errors, predict-first). Timings
are only quotable from a quiet machine: the run is invalid when the load average went
above 1.5 x the CPU count while it measured.

    python bench/predict_validation.py [--suites tiny,smollm2,llamacpp,vllm] [--out DIR] [--skip-predict-first]
                                       [--repeat-sweep]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.validity import Validity  # noqa: E402
from tierguard.common.units import GIB  # noqa: E402
from tierguard.predict.predictor import predict_matrix  # noqa: E402
from tierguard.report.load import load_run  # noqa: E402
from tierguard.report.predicted import boundary_pairs, cell_errors  # noqa: E402
from tierguard.sweep.demo import demo_document  # noqa: E402

TOLERANCE = 0.20
PY = sys.executable


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def loaded(cpus: int) -> bool:
    return os.getloadavg()[0] > 1.5 * cpus


# ---- the suites' matrices ------------------------------------------------------------------

def demo_matrix() -> dict:
    """The demo's matrix as `tierguard demo` runs it: prompts from the tiny model's tokenizer."""
    doc = demo_document()["matrix"]
    for v in doc["variants"]:
        v.pop("requires", None)
    doc["profile"]["tokenizer"] = "tiny"
    return doc


def tiny_suite(contexts: list[int]) -> dict:
    m = demo_matrix()
    m["name"] = "predict-tiny"
    m["profile"]["context_lengths"] = contexts  # the second: a context the probes never ran
    m["slices"].pop("prefix", None)
    return m


def smollm2_suite() -> dict:
    """The demo's variants on SmolLM2: pools sized for its KV (float32, or fp8)."""
    import torch

    from tierguard.engine.model_runner import kv_block_bytes
    from tierguard.model.config import ModelConfig
    from tierguard.model.registry import resolve_model

    cfg = ModelConfig.from_dir(resolve_model("smollm2"))
    ctx, out = 256, 32
    per_tok = {d: kv_block_bytes(cfg, 16, torch.float32, d) / 16 for d in ("auto", "fp8")}
    ref = 16 * (ctx + out + 16) * per_tok["auto"] / GIB * 1.2
    small = 2.5 * (ctx + out) * per_tok["auto"] / GIB
    small_fp8 = small  # same budget, more tokens
    m = demo_matrix()
    m["name"] = "predict-smollm2"
    for v in m["variants"]:
        cmd = v["command"].replace("--model tiny", "--model smollm2").replace("--max-model-len 1088",
                                                                            f"--max-model-len {ctx + out + 32}")
        cmd = cmd.replace("--kv-cache-gib 0.25", f"--kv-cache-gib {ref:.4f}")
        cmd = cmd.replace("--kv-cache-gib 0.006", f"--kv-cache-gib {small_fp8 if 'fp8' in cmd else small:.4f}")
        cmd = cmd.replace("--target-itl-ms 50", "--target-itl-ms 100")
        v["command"] = cmd
    m["profile"].update(model="smollm2", tokenizer="smollm2", context_lengths=[ctx, 192], output_len=out)
    m["slices"].pop("prefix", None)
    m["slo"] = {"p99_ttft_ms": 3000, "p99_itl_ms": 200}
    return m


def llamacpp_suite(python: str) -> dict:
    from tierguard.model.registry import smollm2_gguf

    gguf = smollm2_gguf()
    base = (f"{python} -m llama_cpp.server --model {gguf} --host 127.0.0.1 --port {{port}} --n_ctx 2048 "
            "--interrupt_requests False")
    return {
        "name": "predict-llamacpp",
        "variants": [
            {"name": "llamacpp", "command": base, "start_timeout_s": 300, "health_url": "{base_url}/v1/models"},
            {"name": "llamacpp-batch-64", "command": base + " --n_batch 64", "start_timeout_s": 300,
             "health_url": "{base_url}/v1/models"},
        ],
        "profile": {"tokenizer": "smollm2", "context_lengths": [256, 192], "output_len": 32, "num_requests": 8,
                    "min_rounds": 1, "timeout_s": 300},
        "slices": {"ladder": [1, 2, 4, 8, 16], "bisect": True},
        "slo": {"p99_ttft_ms": 3000, "p99_itl_ms": 200},
        "uncertainty": {"bootstrap": 200},
    }


def vllm_suite(python: str) -> dict:
    from tierguard.model.registry import resolve_model

    model_dir = resolve_model("smollm2")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    base = (f"{python} -m vllm.entrypoints.openai.api_server --model {model_dir} --host 127.0.0.1 --port {{port}} "
            "--served-model-name llm --dtype float32 --max-model-len 1024")
    return {
        "name": "predict-vllm",
        "variants": [
            {"name": "vllm-f32", "command": base, "env": {**env, "VLLM_CPU_KVCACHE_SPACE": "1"},
             "start_timeout_s": 600, "stop_grace_s": 30},
            {"name": "vllm-f32-small-kv", "command": base + " --kv-cache-memory-bytes 82575360", "env": env,
             "start_timeout_s": 600, "stop_grace_s": 30},
        ],
        "profile": {"model": "llm", "tokenizer": "smollm2", "context_lengths": [384, 256], "output_len": 64,
                    "num_requests": 8, "min_rounds": 1, "timeout_s": 300},
        "slices": {"ladder": [1, 2, 4, 8, 16], "bisect": True},
        "slo": {"p99_ttft_ms": 3000, "p99_itl_ms": 250},
        "uncertainty": {"bootstrap": 200},
    }


# ---- running and comparing ---------------------------------------------------------------------

def sweep(matrix_path: Path, run_dir: Path, *extra: str) -> float:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.monotonic()
    proc = subprocess.run([PY, "-m", "tierguard", "sweep", str(matrix_path), "--run-dir", str(run_dir),
                           "--no-report", *extra], capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"sweep {matrix_path.name} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return time.monotonic() - t0


def quiet_sweep(matrix_path: Path, run_dir: Path, v: Validity, cpus: int, label: str) -> tuple[float, list[float]]:
    """`sweep`, invalidating the run when the load average went above 1.5 x the CPUs
    around it. Returns the wall time and the load average before and after."""
    before = os.getloadavg()[0]
    seconds = sweep(matrix_path, run_dir)
    after = os.getloadavg()[0]
    v.require(max(before, after) <= 1.5 * cpus,
              f"{label}: load average {max(before, after):.1f} on {cpus} CPUs while sweeping: timings taken under load")
    return seconds, [round(before, 1), round(after, 1)]


def measured_cells(run_dir: Path) -> dict[str, dict[int, list[int]]]:
    state = json.loads((run_dir / "state.json").read_text())
    out: dict[str, dict[int, list[int]]] = {}
    for name, cells in state["cells"].items():
        for cell in cells.values():
            if cell["slice"] == "ladder":
                out.setdefault(name, {}).setdefault(cell["context"], []).append(cell["concurrency"])
    return out


def summarize_errors(errs) -> dict:
    out = {}
    for metric in ("ttft", "itl"):
        vals = [abs(e.error) for e in errs if e.metric == metric]
        finite = [v for v in vals if math.isfinite(v)]
        out[metric] = {
            "cells": len(vals),
            "within_20pct": sum(v <= TOLERANCE for v in vals),
            "median_abs_error": round(statistics.median(finite), 3) if finite else None,
            "max_abs_error": (round(max(finite), 3) if finite else None) if len(finite) == len(vals) else "inf",
        }
    return out


def run_suite(name: str, doc: dict, out: Path, cache: Path, v: Validity, cpus: int, repeat: bool = False) -> dict:
    sdir = out / name
    sdir.mkdir(parents=True, exist_ok=True)
    mpath = sdir / "matrix.yaml"
    mpath.write_text(yaml.safe_dump(doc, sort_keys=False))
    from tierguard.sweep.matrix import load_matrix

    matrix = load_matrix(mpath)
    log(f"[{name}] predicting (calibration probes when not cached)")
    t0 = time.monotonic()
    pred = sdir / "predicted"
    shutil.rmtree(pred, ignore_errors=True)
    predict_matrix(matrix, pred, cache, log, mpath.read_text())
    predict_s = time.monotonic() - t0
    log(f"[{name}] sweeping")
    sweep_s, loads = quiet_sweep(mpath, sdir / "measured", v, cpus, name)
    log(f"[{name}] predicting every measured cell")
    shutil.rmtree(pred, ignore_errors=True)
    predict_matrix(matrix, pred, cache, log, mpath.read_text(), extra=measured_cells(sdir / "measured"))
    subprocess.run([PY, "-m", "tierguard", "report", str(sdir / "measured"), "--compare", str(pred)],
                   capture_output=True, text=True)
    measured, predicted = load_run(sdir / "measured"), load_run(pred)
    failed = [x.name for x in measured.variants if x.status != "done"]
    v.require(not failed, f"{name}: variants failed in the sweep: {failed}")
    pairs = boundary_pairs(measured, predicted)
    errs = cell_errors(measured, predicted)
    bounds = [{"variant": p.variant, "context": p.context, "measured": p.measured, "predicted": p.predicted,
               "band": p.band, "steps_apart": p.steps_apart, "within_one_step": p.within_one_step} for p in pairs]
    cells = [{"variant": e.variant, "context": e.context, "concurrency": e.concurrency, "metric": e.metric,
              "measured_ms": e.measured_ms if math.isfinite(e.measured_ms) else None,
              "predicted_ms": e.predicted_ms if math.isfinite(e.predicted_ms) else None,
              "error": round(e.error, 3) if math.isfinite(e.error) else "inf", "held_out": e.held_out} for e in errs]
    res = {
        "predict_s": round(predict_s, 1),
        "sweep_s": round(sweep_s, 1),
        "loadavg_during_sweep": loads,
        "boundaries": bounds,
        "boundaries_within_one_step": sum(b["within_one_step"] for b in bounds),
        "boundaries_total": len(bounds),
        "in_sample": summarize_errors([e for e in errs if not e.held_out]),
        "held_out": summarize_errors([e for e in errs if e.held_out]),
        "cells": cells,
        "calibration": predicted.boundary.get("calibration", {}),
    }
    if repeat:
        # the measurement's own reproducibility: the same matrix swept again, cell by cell
        log(f"[{name}] sweeping again")
        quiet_sweep(mpath, sdir / "measured-again", v, cpus, f"{name} (again)")
        again = load_run(sdir / "measured-again")
        res["measured_again"] = {"against_first_sweep": summarize_errors(cell_errors(measured, again)),
                                 "prediction_against_it": summarize_errors(cell_errors(again, predicted))}
    naive = [x for x in measured.matrix.variants if "naive-sync-disk" in x.tags]
    small = [x for x in measured.matrix.variants if "no-tier" in x.tags]
    if naive and small:
        def b(run, variant):
            vd = next(x for x in run.variants if x.name == variant)
            return {c: (vd.boundaries.get(c) or {}).get("max_concurrency") or 0 for c in matrix.profile.context_lengths}

        res["naive_collapse"] = {
            "measured": {"naive": b(measured, naive[0].name), "small_pool": b(measured, small[0].name)},
            "predicted": {"naive": b(predicted, naive[0].name), "small_pool": b(predicted, small[0].name)},
        }
    return res


def scale_slo(doc: dict, factor: float) -> dict:
    doc["slo"] = {k: v * factor for k, v in doc["slo"].items()}
    return doc


def predict_first(out: Path, cache: Path, v: Validity, cpus: int, slo_scale: float,
                  contexts: list[int] | None) -> dict:
    """The demo matrix swept plainly and with --predict-first (its calibrations cached)."""
    doc = scale_slo(demo_matrix(), slo_scale)
    if contexts:
        doc["profile"]["context_lengths"] = contexts
    pdir = out / "predict-first"
    pdir.mkdir(parents=True, exist_ok=True)
    mpath = pdir / "demo.yaml"
    mpath.write_text(yaml.safe_dump(doc, sort_keys=False))
    loads = [os.getloadavg()[0]]
    plain_s = sweep(mpath, pdir / "plain")
    loads.append(os.getloadavg()[0])
    first_s = sweep(mpath, pdir / "first", "--predict-first", "--calibration-dir", str(cache))
    loads.append(os.getloadavg()[0])
    v.require(max(loads) <= 1.5 * cpus, f"predict-first: load average up to {max(loads):.1f} on {cpus} CPUs")

    def table(d: Path) -> dict:
        doc = json.loads((d / "boundary.json").read_text())
        return {n: {c: (b or {}).get("max_concurrency") for c, b in x["contexts"].items()} for n, x in
                doc["variants"].items()}

    def cells(d: Path) -> int:
        return sum(len(c) for c in json.loads((d / "state.json").read_text())["cells"].values())

    pf = json.loads((pdir / "first" / "predict_first.json").read_text())
    plain, first = table(pdir / "plain"), table(pdir / "first")
    return {
        "plain_sweep_s": round(plain_s, 1),
        "predict_first_s": round(first_s, 1),
        "of_which_prediction_s": pf["predict_s"],
        "saved": round(1 - first_s / plain_s, 3) if plain_s else None,
        "cells_plain": cells(pdir / "plain"),
        "cells_predict_first": cells(pdir / "first"),
        "boundaries_plain": plain,
        "boundaries_predict_first": first,
        "same_boundaries": plain == first,
        "loadavg": [round(x, 1) for x in loads],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suites", default="tiny,smollm2,llamacpp,vllm")
    ap.add_argument("--out", default="predict-validation")
    ap.add_argument("--calibration-dir", default=None, help="default: OUT/cache (fresh calibrations)")
    ap.add_argument("--llama-python", default=os.environ.get("TIERGUARD_LLAMA_PYTHON")
                    or str(ROOT / ".venv-llamacpp" / "bin" / "python"))
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--skip-predict-first", action="store_true")
    ap.add_argument("--repeat-sweep", action="store_true",
                    help="sweep each suite twice: how far two measurements of a cell are apart")
    ap.add_argument("--slo-scale", type=float, default=1.0,
                    help="multiply every suite's SLOs (on a loaded machine, so boundaries fall inside the ladder)")
    ap.add_argument("--tiny-contexts", default="1024,768", help="the tiny suite's contexts (the last: held out)")
    ap.add_argument("--demo-contexts", default=None, help="predict-first: override the demo's contexts")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.calibration_dir) if args.calibration_dir else out / "cache"
    cpus = os.cpu_count() or 1
    v = Validity()
    result: dict = {"machine": {"cpus": cpus, "loadavg_at_start": [round(x, 1) for x in os.getloadavg()],
                                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                    "tolerance": TOLERANCE, "suites": {}, "skipped": {}}
    tiny_ctx = [int(x) for x in args.tiny_contexts.split(",")]
    demo_ctx = [int(x) for x in args.demo_contexts.split(",")] if args.demo_contexts else None
    result["slo_scale"] = args.slo_scale
    v.require(args.slo_scale == 1.0, f"SLOs scaled by {args.slo_scale:g}: not the matrices' own SLOs")
    builders = {"tiny": lambda: tiny_suite(tiny_ctx), "smollm2": smollm2_suite,
                "llamacpp": lambda: llamacpp_suite(args.llama_python), "vllm": lambda: vllm_suite(args.vllm_python)}
    for name in [s.strip() for s in args.suites.split(",") if s.strip()]:
        if name == "llamacpp" and subprocess.run([args.llama_python, "-c", "import llama_cpp.server.app"],
                                                 capture_output=True).returncode != 0:
            result["skipped"][name] = f"{args.llama_python} cannot import llama_cpp.server"
            continue
        if name == "vllm" and not Path(args.vllm_python).is_file():
            result["skipped"][name] = f"no vLLM interpreter at {args.vllm_python} (make vllm)"
            continue
        try:
            doc = scale_slo(copy.deepcopy(builders[name]()), args.slo_scale)
        except Exception as exc:  # noqa: BLE001 - a suite that cannot be built is reported, not fatal
            result["skipped"][name] = f"{type(exc).__name__}: {exc}"
            continue
        result["suites"][name] = run_suite(name, doc, out, cache, v, cpus, args.repeat_sweep)
    if not args.skip_predict_first:
        result["predict_first"] = predict_first(out, cache, v, cpus, args.slo_scale, demo_ctx)
    v.require(bool(result["suites"]), "no suite ran")
    suites = result["suites"].values()
    result.update(v.as_dict())
    result["goal_boundaries_within_one_step"] = v.goal(all(
        s["boundaries_within_one_step"] == s["boundaries_total"] for s in suites))
    result["goal_p99_within_20pct_in_sample"] = v.goal(all(
        s["in_sample"][m]["within_20pct"] == s["in_sample"][m]["cells"] for s in suites for m in ("ttft", "itl")))
    result["goal_naive_collapse_predicted"] = v.goal(all(
        all(n < s["naive_collapse"]["predicted"]["small_pool"][c] for c, n in
            s["naive_collapse"]["predicted"]["naive"].items()) for s in suites if "naive_collapse" in s))
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
