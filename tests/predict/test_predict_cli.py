"""`tierguard predict` end to end on cached calibrations (no server is started), the
report of a prediction, a prediction beside a sweep, and bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml

from tierguard.cli.main import main
from tierguard.engine.config import EngineConfig
from tierguard.kv.spec import KVLayout
from tierguard.model.config import ModelConfig
from tierguard.predict import calibrate
from tierguard.predict.calibrate import Cache, Calibration, ProbePlan, digest, machine_id
from tierguard.predict.driver import ClientTiming
from tierguard.predict.media import ROUTES, MediaCost, RouteCost
from tierguard.predict.predictor import media_key
from tierguard.sweep.matrix import load_matrix

from .conftest import pinned_cost

SERVE = "{python} -m tierguard serve --model tiny --port {port} --max-model-len 256 --max-num-seqs 8 " \
        "--max-num-batched-tokens 128 --target-itl-ms 20"
POOLS = {"reference": 600, "small-pool": 40, "naive-sync-disk": 40}
TIERS = "--kv-host-gib 0.01 --kv-disk-dir {workdir}/kv-disk --kv-disk-gib 0.1 --kv-naive-sync-disk"
COMMANDS = {
    "reference": SERVE + " --kv-cache-gib 0.1",
    "small-pool": SERVE + " --kv-cache-gib 0.001",
    "naive-sync-disk": SERVE + " --kv-cache-gib 0.001 " + TIERS,
}
# What each variant's compute probe runs, written out here rather than derived by the
# code under test: the serve command without its KV budget and its port, its tiers kept,
# on a port of its own with a step log. The reference and small-pool differ only in the
# budget, so they share one probe and one calibration.
_BASE = "{python} -m tierguard serve --model tiny --max-model-len 256 --max-num-seqs 8 " \
        "--max-num-batched-tokens 128 --target-itl-ms 20"
_TAIL = " --port {port} --step-log {workdir}/steps.jsonl"
PROBES = {
    "reference": _BASE + _TAIL,
    "small-pool": _BASE + _TAIL,
    "naive-sync-disk": _BASE + " " + TIERS + _TAIL,
}


def write_matrix(path: Path) -> Path:
    doc = {
        "name": "predict-test",
        "variants": [
            {"name": "reference", "command": COMMANDS["reference"]},
            {"name": "small-pool", "command": COMMANDS["small-pool"]},
            {"name": "naive-sync-disk", "command": COMMANDS["naive-sync-disk"], "tags": ["naive-sync-disk"]},
        ],
        "profile": {"model": "tiny", "context_lengths": [96], "output_len": 8, "num_requests": 4, "min_rounds": 1},
        "slices": {"ladder": [1, 2, 4, 8], "bisect": True},
        "slo": {"p99_ttft_ms": 400, "p99_itl_ms": 60},
        "uncertainty": {"bootstrap": 20},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def seed_cache(matrix_path: Path, cache_dir: Path, run_dir: Path) -> None:
    """What calibration would have stored: each variant's step-log header, a compute
    calibration per probe command (PROBES: one for the two variants that differ only in
    KV budget), media timings. Keys are built from the commands as written above, so a
    probe command the code derives differently misses the cache (and `predicted` fails)."""
    matrix = load_matrix(matrix_path)
    cache = Cache(cache_dir)
    mc = ModelConfig("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 512, eos_token_ids=[3])
    layout = KVLayout(2, 2, 16, 16, "float32")
    for v in matrix.variants:
        cfg = EngineConfig(num_blocks=POOLS[v.name], block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
                           max_model_len=256, target_itl_ms=20.0)
        if v.name == "naive-sync-disk":
            cfg = dataclasses.replace(cfg, kv_host_gib=0.01, kv_disk_dir="/unused", kv_disk_gib=0.1,
                                      naive_sync_disk=True)
        header = {"kind": "header", "engine_config": dataclasses.asdict(cfg), "model_config": vars(mc),
                  "kv_layout": dataclasses.asdict(layout), "fused_max_rows": 0, "model_name": "tiny"}
        cache.put("header", digest({"argv": COMMANDS[v.name].split(), "env": {}, "machine": machine_id()}),
                  {"header": header})
        plan = ProbePlan.for_matrix(matrix, 256)
        key = digest({"argv": PROBES[v.name].split(), "env": {}, "plan": plan.to_json(), "machine": machine_id()})
        cal = Calibration("tierguard", key, pinned_cost(gap_ms=(0.2, 0.02)), ClientTiming(0.002, 0.001), plan, 0.1)
        cache.put("tierguard", key, cal.to_json())
    # media: the naive baseline's page-out costs 4 ms a block (1 ms for a block already on
    # disk), its read 2 ms
    media = MediaCost({r: RouteCost(0.0002, 0.0005) for r in ROUTES}, layout.block_bytes)
    media.routes["naive_spill"], media.routes["naive_restore"] = RouteCost(0.0, 0.004), RouteCost(0.0, 0.002)
    media.routes["naive_respill"] = RouteCost(0.0, 0.001)
    scratch = run_dir / "naive-sync-disk" / "calibration"
    scratch.mkdir(parents=True)
    cache.put("media", media_key(layout, scratch), {"media": media.to_json()})


@pytest.fixture
def predicted(tmp_path, capsys, monkeypatch):
    def no_server(variant, argv, *a, **kw):  # a cache miss would start one: fail at once instead
        pytest.fail(f"{variant.name}: not found in the calibration cache, would start {' '.join(argv)}")

    monkeypatch.setattr(calibrate, "_start", no_server)
    m = write_matrix(tmp_path / "m.yaml")
    run_dir, cache = tmp_path / "pred", tmp_path / "cache"
    seed_cache(m, cache, run_dir)
    rc = main(["predict", str(m), "--run-dir", str(run_dir), "--calibration-dir", str(cache)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return m, run_dir, out


def test_predict_writes_the_sweep_layout_marked_as_predicted(predicted):
    m, run_dir, out = predicted
    assert "starting" not in out.err  # every calibration came from the cache
    doc = json.loads((run_dir / "boundary.json").read_text())
    assert doc["predicted"] is True
    bounds = {n: v["contexts"]["96"] for n, v in doc["variants"].items()}
    assert all(v["status"] == "done" for v in doc["variants"].values())
    ref, small, naive = (bounds[n]["max_concurrency"] or 0 for n in ("reference", "small-pool", "naive-sync-disk"))
    assert ref >= small > naive, bounds  # the naive baseline's collapse is predicted
    assert bounds["naive-sync-disk"]["limited_by"] == ["itl"]
    for b in bounds.values():
        lo, hi = b["uncertainty"]["range"]
        assert (lo or 0) <= (b["max_concurrency"] or 0) <= (hi or 0)
    cal = doc["calibration"]["naive-sync-disk"]
    assert cal["engine_config"]["naive_sync_disk"] and cal["media_ms"]["routes"]["naive_spill"]["per_block_ms"] == 4.0
    cell = run_dir / "reference" / "ladder-ctx96-c2" / "r0"
    recs = [json.loads(x) for x in (cell / "requests.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(r["status"] == "ok" and r["output_tokens"] == 8 for r in recs)
    assert json.loads((cell / "run.json").read_text())["predicted"] is True
    assert (run_dir / "report" / "report.html").read_text().count("tierguard prediction") == 1


def test_a_prediction_beside_its_sweep(predicted, tmp_path, capsys):
    m, run_dir, _ = predicted
    measured = tmp_path / "measured"
    shutil.copytree(run_dir, measured)  # stands in for a sweep: the same cells, not predicted
    state = json.loads((measured / "state.json").read_text())
    del state["predicted"]
    (measured / "state.json").write_text(json.dumps(state))
    assert main(["report", str(measured), "--compare", str(run_dir)]) == 0
    md = (measured / "report" / "report.md").read_text()
    assert "Predicted vs measured" in md
    assert "(+0%)" in md and "held out" in md and "in sample" in md
    from tierguard.report.load import load_run, with_companion
    from tierguard.report.predicted import boundary_pairs

    data = with_companion(load_run(measured), run_dir)
    assert all(p.within_one_step and p.steps_apart == 0 for p in boundary_pairs(data, data.companion))
    capsys.readouterr()
    assert main(["report", str(run_dir), "--compare", str(run_dir)]) == 2
    assert "compare a prediction with a measured sweep" in capsys.readouterr().err


def test_bad_input_is_one_line(tmp_path, capsys):
    m = write_matrix(tmp_path / "m.yaml")
    assert main(["predict", str(m), "--variant", "nope", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--variant 'nope'" in capsys.readouterr().err
    assert main(["predict", str(m), "--ramp", "2,x", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--ramp" in capsys.readouterr().err
    assert main(["predict", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
