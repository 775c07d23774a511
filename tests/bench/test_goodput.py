"""bench/goodput.py: the goodput cells compare each engine's best setting under a p99-gap
bound, a quantized setting counts only at its quality bar, and the raw, batch-1 and TTFT
goals compare the settings they name."""

from __future__ import annotations

import pytest

from tests.bench.bench_scripts import bench_module


@pytest.fixture(scope="module")
def gp():
    return bench_module("goodput")


def lv(tok_s: float, p99: float, p50: float = 10.0, ttft: float = 500.0, valid: bool = True) -> dict:
    return {"valid": valid, "invalid_reasons": [], "output_tok_s": tok_s, "itl_p50_ms": p50, "itl_p99_ms": p99,
            "ttft_p50_ms": ttft, "requests": 10, "output_tokens": int(tok_s * 10), "wall_s": 10.0}


def server(levels: dict, agreement: float = 1.0, flags: str = "") -> dict:
    return {"server": {"extra_flags": flags}, "agreement": {"agreement": agreement},
            "levels": {str(c): v for c, v in levels.items()}}


SERVERS = {
    "tierguard-bf16": server({1: lv(90, 15, p50=9), 8: lv(300, 120), 32: lv(320, 150, ttft=900)}),
    "tierguard-bf16@slo40": server({8: lv(250, 45), 32: lv(200, 48)}, flags="--itl-slo-ms 40"),
    "tierguard-int8": server({1: lv(120, 10, p50=7), 8: lv(400, 40)}),
    "vllm-bf16": server({1: lv(50, 25, p50=20), 8: lv(220, 103), 32: lv(300, 733, ttft=1200)}),
    "vllm-bf16@b256": server({8: lv(200, 60), 32: lv(260, 90)}, flags="--max-num-batched-tokens 256"),
}


# teacher-forced top-1 agreement of each tierguard weight format (weight_quant_quality)
QUALITY = {"bf16": {"agreement": 0.992}, "int8": {"agreement": 0.95}}  # int8 below its bar


def test_each_cell_is_the_best_setting_under_the_bound(gp):
    t = gp.table(SERVERS, QUALITY)
    assert t["c8_p99_le_50ms"]["tierguard"]["server"] == "tierguard-bf16@slo40"
    assert "vllm" not in t["c8_p99_le_50ms"]  # no vLLM setting stayed under 50 ms at C=8
    assert t["c8_p99_le_200ms"]["tierguard"]["output_tok_s"] == 300
    assert t["c8_p99_le_200ms"]["vllm"]["server"] == "vllm-bf16"
    assert t["c32_p99_le_100ms"]["vllm"]["server"] == "vllm-bf16@b256"
    assert t["c32_p99_le_200ms"]["tierguard"]["server"] == "tierguard-bf16"


def test_a_quantized_setting_below_its_quality_bar_counts_nowhere(gp):
    t = gp.table(SERVERS, QUALITY)
    assert all(cell.get("tierguard", {}).get("server") != "tierguard-int8" for cell in t.values())
    assert gp.table(SERVERS, None)["c8_p99_le_50ms"]["tierguard"]["server"] != "tierguard-int8"  # unmeasured
    good = {**QUALITY, "int8": {"agreement": 0.99}}
    assert gp.table(SERVERS, good)["c8_p99_le_50ms"]["tierguard"]["server"] == "tierguard-int8"
    assert gp.targets(SERVERS, gp.table(SERVERS, good), good)["c1_itl_over_vllm_best"] == 0.35
    # another engine's quantized row is judged on its greedy text's agreement
    q8 = {"llamacpp-q8_0": server({8: lv(100, 20)}, agreement=0.79)}
    assert gp.table(q8, good)["c8_p99_le_50ms"] == {}
    # invalid levels never count, whatever their numbers
    bad = {"tierguard-bf16": server({8: lv(900, 5, valid=False)})}
    assert gp.table(bad)["c8_p99_le_50ms"] == {}


def test_targets(gp):
    t = gp.targets(SERVERS, gp.table(SERVERS, QUALITY), QUALITY)
    # c32 <= 100 ms: ours 200 (slo40) against vLLM's 260 (b256): not every cell
    assert t["goodput_cells"]["c32_p99_le_100ms"] is False
    assert t["goodput_cells"]["c8_p99_le_50ms"] is True  # vLLM reached it at no setting
    assert t["tierguard_ge_vllm_every_goodput_cell"] is False
    # raw C=32: the settings without an SLO with the most tok/s on each side
    assert t["raw_c32"]["tierguard"] == "tierguard-bf16" and t["raw_c32"]["vllm"] == "vllm-bf16"
    assert t["raw_c32_tok_s_ge_vllm"] is True and t["c32_ttft_p50_le_vllm"] is True
    assert t["raw_c32_p99_gap_over_own_c1_itl"] == round(150 / 9, 3)
    assert t["raw_c32_p99_gap_le_4x_own_c1_itl"] is False
    assert t["c1_itl_over_vllm_best"] == 0.45 and t["c1_itl_le_0.6x_vllm_best"] is True
    # a cell neither engine reached is no verdict; a missing vLLM leaves the raw goals open
    only_ours = {k: v for k, v in SERVERS.items() if k.startswith("tierguard")}
    t2 = gp.targets(only_ours, gp.table(only_ours, QUALITY), QUALITY)
    assert t2["raw_c32_tok_s_ge_vllm"] is None and t2["c1_itl_le_0.6x_vllm_best"] is None


def test_flops_and_peak_fraction(gp, tmp_path):
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,'
        ' "num_key_value_heads": 1, "head_dim": 2, "vocab_size": 10}')
    fpt = gp.flops_per_token(tmp_path)
    per_layer = 4 * 4 + 2 * 4 * 2 + 4 * 4 + 3 * 4 * 8  # q, k + v, o, gate + up + down
    assert fpt == {"prompt": 2.0 * 2 * per_layer, "output": 2.0 * 2 * per_layer + 2.0 * 4 * 10}
    rows = gp.peak_rows({"vllm-bf16": server({8: lv(100, 50)}), "tierguard-int8": server({8: lv(100, 50)})},
                        {"bfloat16_dot": 1e9, "float32_fma": 2e9}, fpt, prompt_tokens=3)
    achieved = (10 * 3 * fpt["prompt"] + 1000 * fpt["output"]) / 10.0
    assert rows["vllm-bf16"]["peak_kind"] == "bfloat16_dot"
    assert rows["vllm-bf16"]["8"]["fraction"] == round(achieved / 1e9, 4)
    assert rows["tierguard-int8"]["peak_kind"] == "float32_fma"  # weight-only int8 multiplies in float32
    assert rows["tierguard-int8"]["8"]["fraction"] == round(achieved / 2e9, 4)


def test_weight_format_is_the_name_part_after_the_engine(gp):
    assert gp.weights_of("tierguard-int8@slo12") == "int8"
    assert gp.weights_of("vllm-f32-default-threads") == "f32"
    assert gp.weights_of("llamacpp-q8_0") == "q8_0"
    assert gp.weights_of("transformers") == ""
