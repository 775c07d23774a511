"""The remedy ladder's order and stopping rule, host budgets and engine flags."""

from __future__ import annotations

import math

import pytest

from tierguard.common.units import GIB
from tierguard.plan import PlanInputs, make_plan

ORDER = [
    "trim_history",
    "prefix_caching",
    "kv_quantization",
    "limit_long_sessions",
    "ram_kv_offload",
    "weight_offload",
]


def plan(**kw) -> dict:
    # Llama-3.1-8B on an L40S: ~23 GiB of KV, i.e. five 32k-token fp16 sessions.
    base = dict(
        model="meta-llama/Llama-3.1-8B",
        gpu="L40S",
        kv_dtype="fp16",
        contexts=[32768],
        concurrency=8,
        host_ram_gib=256,
    )
    base.update(kw)
    return make_plan(PlanInputs(**base))


def names(p: dict) -> list[str]:
    return [s["step"] for s in p["ladder"]]


def assert_stops_at(p: dict, step: str) -> None:
    """Steps are in R7 order, numbered, and only the last one fits."""
    got = names(p)
    assert got == ORDER[: ORDER.index(step) + 1]
    assert [s["number"] for s in p["ladder"]] == list(range(1, len(got) + 1))
    assert [s["fits"] for s in p["ladder"]] == [False] * (len(got) - 1) + [True]
    assert p["fits_after_ladder"] and not p["fits"]


def test_no_ladder_when_it_already_fits():
    p = plan(concurrency=4)
    assert p["fits"] and p["ladder"] == []


def test_trim_history_reports_what_fits_and_stops_when_allowed():
    p = plan(trim_to=16384)
    assert_stops_at(p, "trim_history")
    fit = p["ladder"][0]["context_that_fits"]
    # The context that fits really fits eight sessions, one more block does not.
    avail = p["gpu"]["kv_available_bytes_per_gpu"]
    per_token = p["kv"]["bytes_per_token_per_gpu"]
    assert 8 * fit * per_token <= avail < 8 * (fit + 16) * per_token
    assert p["flags"]["vllm"][p["flags"]["vllm"].index("--max-model-len") + 1] == "16384"


def test_prefix_caching_counts_shared_prefix_once():
    p = plan(shared_prefix=24576)
    assert_stops_at(p, "prefix_caching")
    assert p["ladder"][1]["saves_bytes"] == 7 * 24576 * p["kv"]["bytes_per_token_per_gpu"]
    assert "--enable-prefix-caching" in p["flags"]["vllm"]


def test_kv_quantization_halves_fp16_and_stops():
    p = plan()
    assert_stops_at(p, "kv_quantization")
    assert p["ladder"][2]["saves_bytes"] == 8 * 4 * GIB // 2
    assert "--kv-cache-dtype" in p["flags"]["vllm"] and "fp8" in p["flags"]["vllm"]
    ll = p["flags"]["llamacpp"]
    assert ll[ll.index("-ctv") + 1] == "q8_0" and "-fa" in ll  # quantized V needs flash attention


def test_limit_long_sessions_when_allowed():
    p = plan(allow_kv_quant=False, min_concurrency=4)
    assert_stops_at(p, "limit_long_sessions")
    k = p["ladder"][3]["sessions_that_fit"]
    assert k == math.floor(p["max_concurrency"]["32768"]) and 4 <= k < 8
    assert p["flags"]["vllm"][p["flags"]["vllm"].index("--max-num-seqs") + 1] == str(k)


def test_ram_kv_offload_sized_to_overflow():
    p = plan(allow_kv_quant=False)
    assert_stops_at(p, "ram_kv_offload")
    overflow = 8 * 4 * GIB - p["gpu"]["kv_available_bytes_per_gpu"]
    assert p["host"]["kv_offload_bytes"] == overflow
    v = p["flags"]["vllm"]
    assert float(v[v.index("--kv-offloading-size") + 1]) * GIB >= overflow
    assert v[v.index("--kv-offloading-backend") + 1] == "native"


def test_weight_offload_is_last():
    p = plan(allow_kv_quant=False, kv_offload_gib=2.0, weights_offload_gib=16.0)
    assert_stops_at(p, "weight_offload")
    w = p["final"]["weights_offload_bytes_per_gpu"]
    assert w > 0 and "--cpu-offload-gb" in p["flags"]["vllm"]
    assert p["host"]["warnings"] == []  # both offloads, each with its own limit


def test_does_not_fit_when_every_step_fails():
    p = plan(allow_kv_quant=False, contexts=[131072], concurrency=64, host_ram_gib=32)
    assert names(p) == ORDER and not p["fits_after_ladder"]


def test_both_offloads_without_limits_warn():
    p = plan(allow_kv_quant=False, kv_offload_gib=2.0)  # weights budget left to the default
    assert "weight_offload" in names(p)
    assert any("without separate limits" in w for w in p["host"]["warnings"])


def test_pinned_cap_warning():
    p = plan(allow_kv_quant=False, kv_offload_gib=20.0, pinned_cap_gib=4.0)
    assert any("pinned host memory" in w for w in p["warnings"])


def test_host_reserves_come_first():
    h = plan(concurrency=1)["host"]
    reserves = h["os_reserve_bytes"] + h["page_cache_reserve_bytes"] + h["services_reserve_bytes"]
    assert h["usable_bytes"] == h["total_bytes"] - reserves
    assert h["pinned_cap_bytes"] < h["usable_bytes"]
    assert h["kv_offload_budget_bytes"] + h["weights_offload_budget_bytes"] <= h["pinned_cap_bytes"]


def test_tp_trap_and_total_vs_per_gpu_units():
    p = make_plan(
        PlanInputs(
            model="meta-llama/Llama-3.1-70B",
            gpu="H100-80GB",
            tp=4,
            contexts=[131072],
            concurrency=8,
            kv_dtype="fp16",
            allow_kv_quant=False,
            host_ram_gib=1024,
        )
    )
    assert names(p)[-1] == "ram_kv_offload" and p["fits_after_ladder"]
    total = p["final"]["kv_offload_bytes_total"]
    v = p["flags"]["vllm"]
    size = float(v[v.index("--kv-offloading-size") + 1])
    assert size * GIB >= total and size == pytest.approx(total / GIB, abs=0.11)  # TOTAL, not per rank
    assert "TOTAL across all 4 TP ranks" in p["tp_trap"] and "PER GPU" in p["tp_trap"]
    assert plan()["tp_trap"] is None


def test_flags_use_each_engines_own_names():
    p = plan(
        allow_kv_quant=False, kv_offload_gib=2.0, weights_offload_gib=16.0, nvme_gib=500, engine="tierguard"
    )
    tg = p["flags"]["tierguard"]
    allowed = {
        "--kv-cache-gib",
        "--kv-dtype",
        "--kv-host-gib",
        "--kv-disk-dir",
        "--kv-disk-gib",
        "--weights-offload-gib",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-model-len",
    }
    assert {f for f in tg if f.startswith("--")} <= allowed
    assert {"--kv-host-gib", "--kv-disk-gib", "--weights-offload-gib"} <= set(tg)
    sg = p["flags"]["sglang"]
    frac = float(sg[sg.index("--mem-fraction-static") + 1])
    assert 0 < frac <= p["settings"]["gpu_memory_utilization"]
    llama = make_plan(
        PlanInputs(model="meta-llama/Llama-3.1-8B", gpu="L4", engine="llamacpp", host_ram_gib=64)
    )
    assert llama["kv"]["dtype"] == "f16"


def test_offload_both_requested_without_limits_warns_even_when_it_fits():
    p = plan(concurrency=1, offload="both")
    assert p["fits"] and any("without separate limits" in w for w in p["warnings"])
    q = plan(concurrency=1, offload="both", kv_offload_gib=8.0, weights_offload_gib=8.0)
    assert not any("without separate limits" in w for w in q["warnings"])
