"""Calibration against public vLLM startup logs: data, version rules, leave-one-out.

The leave-one-out run plans every logged run from its config and settings alone, with the
reserve coefficients fitted on the other rows, and compares vLLM's "GPU KV cache size".
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.plan import PlanInputs, make_plan
from tierguard.plan.calibration import leave_one_out, report
from tierguard.plan.catalogue import load_model
from tierguard.plan.dtypes import weight_format
from tierguard.plan.fit import load_rows
from tierguard.plan.reserves import default_batching, engine_rules
from tierguard.plan.weights import estimate_weights

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan-calibration.md"
ROWS = load_rows()


@pytest.fixture(scope="module")
def preds():
    return leave_one_out(ROWS)


def _num(x: float) -> list[str]:
    """Spellings a logged number has in a log line (58.11, 32.0 / 32, 2.10 / 2.1)."""
    return [f"{x:g}", f"{x:.2f}", f"{x:.1f}"]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_each_row_is_sourced_and_its_numbers_are_in_the_quoted_lines(row):
    r = row.raw
    assert r["source"].startswith("https://")
    text = "\n".join(r["quoted"])
    assert text.strip()
    for key in ("kv_available_gib", "non_torch_gib"):
        if row.logged.get(key) is not None:
            assert any(s in text for s in _num(row.logged[key])), key
    tokens = row.logged.get("kv_tokens")
    if tokens is not None:
        spelled = [f"{tokens:,}", str(tokens), str(tokens // r["block_size"])]
        assert any(re.search(rf"\b{re.escape(s)}\b", text) for s in spelled)
    if row.excluded:
        assert len(r["exclude"]) > 80  # the reason is written out, not a flag


def test_calibration_set_covers_the_required_spread():
    rows = [r for r in ROWS if not r.excluded]
    families = {load_model(r.raw["model"]).architecture for r in rows}
    versions = {engine_rules(r.raw["vllm_version"]).band.name for r in rows}
    assert len(rows) >= 20
    assert len(families) >= 5
    assert len({r.raw["gpu"] for r in rows}) >= 3
    assert {1, 8} <= {r.raw["tp"] for r in rows}
    assert {"0.6", "0.8", "0.12"} <= versions


def test_weights_estimate_matches_logged_weights():
    for row in ROWS:
        w, r = row.logged.get("weights_gib"), row.raw
        if w is None or r["pp"] > 1:  # a pipeline log shows one stage, not the largest
            continue
        spec = load_model(r["model"])
        est = estimate_weights(
            spec, weight_format(r["weights_dtype"], spec.torch_dtype, spec.quantization), r["tp"]
        )
        assert est.per_gpu_bytes / GIB == pytest.approx(w, rel=0.06), row.id


def test_leave_one_out_meets_the_targets(preds):
    included = [p for p in preds if not p.excluded]
    worst = max(included, key=lambda p: abs(p.error))
    assert abs(worst.error) <= 0.10, worst
    for band in {p.band for p in included}:
        errs = [abs(p.error) for p in included if p.band == band]
        assert statistics.median(errs) <= 0.03, band


def test_docs_show_the_current_leave_one_out_table(preds):
    text = DOC.read_text(encoding="utf-8")
    block = re.search(r"<!-- calibration:begin -->\n(.*?)\n<!-- calibration:end -->", text, re.S)
    assert block, "docs/plan-calibration.md lacks the generated block"
    assert block.group(1).strip() == report(preds).strip(), "regenerate: python -m tierguard.plan.calibration"


def test_version_bands_and_serve_defaults():
    assert engine_rules("0.6.4.post1").band.name == "0.6"
    assert engine_rules("v0.11.0").band.name == "0.8"
    assert engine_rules("0.19.0").band.name == "0.12"
    assert engine_rules(None).band.name == engine_rules("0.25.1").band.name == "0.21"
    with pytest.raises(TierguardError, match="older than 0.6"):
        engine_rules("0.5.4")
    with pytest.raises(TierguardError, match="not a version"):
        engine_rules("nightly")
    h100, a100 = int(79.19 * GIB), int(79.15 * GIB)
    assert default_batching(engine_rules("0.19.0"), "H100-80GB", h100, 8192)[:2] == (8192, 1024)
    assert default_batching(engine_rules("0.19.0"), "A100-80GB", a100, 8192)[:2] == (2048, 256)
    assert default_batching(engine_rules("0.8.2"), "H100-80GB", h100, 8192)[:2] == (8192, 256)
    assert default_batching(engine_rules("0.6.4"), "RTX-3090", h100, 20000)[:2] == (20000, 256)
    assert default_batching(engine_rules("0.6.4"), "RTX-3090", h100, 40000)[:2] == (512, 256)


def test_cuda_graphs_leave_the_kv_pool_only_from_0_21():
    def gpu(version):
        return make_plan(
            PlanInputs(model="Qwen/Qwen3-8B", gpu="H100-80GB", engine_version=version, host_ram_gib=64)
        )["gpu"]

    old, new = gpu("0.19.0"), gpu("0.21.0")
    assert not old["cuda_graph_in_budget"] and new["cuda_graph_in_budget"]
    assert new["cuda_graph_bytes"] > 0.3 * GIB
    assert old["kv_available_bytes_per_gpu"] - new["kv_available_bytes_per_gpu"] == new["cuda_graph_bytes"]


def test_activation_follows_the_version_sampler():
    def act(version):
        p = PlanInputs(model="openai/gpt-oss-20b", gpu="H100-80GB", engine_version=version, host_ram_gib=64)
        return make_plan(p)["gpu"]["activation_peak_bytes"] / GIB

    # 1024 sequences x 201,088 logits: 7.38 GiB logged by 0.11, 2.87 GiB by 0.19 (TP2 row).
    assert act("0.11.0") == pytest.approx(7.38, rel=0.05)
    assert act("0.19.0") == pytest.approx(2.87, rel=0.05)
