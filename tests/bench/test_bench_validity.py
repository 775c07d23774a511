"""The bench scripts' validity rules: a run that failed or did not exercise its subject is
"valid": false with reasons, and a goal measured on it is null, never met. One test per
bench the README or docs quote (bench/serve_vs_peers.py has its own), each feeding the
script's own judging function a broken run (and, where cheap, a good one)."""

from __future__ import annotations

import argparse

import pytest

from tests.bench.bench_scripts import bench_module, on_path
from tests.bench.bench_scripts import fresh_bench_module as load


@pytest.fixture(scope="module")
def bench_modules():
    with on_path():
        yield bench_module("tier_scenario"), bench_module("validity")


def _result(counters: dict, errors: list[str] | None = None, requests: int = 9, empty: int = 0) -> dict:
    return {"requests": requests, "errors": errors or [], "empty_streams": empty, "tier_counters": counters}


def test_goal_is_null_on_an_invalid_run(bench_modules):
    _, validity = bench_modules
    v = validity.Validity()
    assert v.goal(True) is True and v.as_dict() == {"valid": True, "invalid_reasons": []}
    assert not v.require(False, "2 requests failed")
    assert v.goal(True) is None and v.as_dict() == {"valid": False, "invalid_reasons": ["2 requests failed"]}


def test_tier_scenario_requires_errors_free_streams_and_used_tiers(bench_modules):
    tier_scenario, _ = bench_modules
    a = argparse.Namespace(chats=4, chat_turns=2)
    used = {"kv_swap_out_blocks": 12.0, "kv_offloaded_blocks": 0.0, "kv_host_hits": 0.0, "kv_disk_hits": 5.0}
    assert tier_scenario.check("contract", _result(used), a).valid
    assert tier_scenario.check("reference", _result({}), a).valid  # no tiers to use
    # tiers configured but never read: the contract's numbers are the reference's
    idle = tier_scenario.check("contract", _result({**used, "kv_disk_hits": 0.0}), a)
    assert not idle.valid and "never read" in idle.reasons[0]
    # a counter missing from /metrics (renamed?) counts as not exercised, not as fine
    assert not tier_scenario.check("naive", _result({}), a).valid
    broken = tier_scenario.check("contract", _result(used, errors=["HTTP 500: boom"], requests=8, empty=1), a)
    assert len(broken.reasons) == 3 and "HTTP 500" in " ".join(broken.reasons)
    # a server whose pool is not the one the scenario sized measured another scenario
    resized = tier_scenario.check("contract", {**_result(used), "kv_blocks_total": 170.0}, a, blocks=169)
    assert not resized.valid and "169" in resized.reasons[0]


@pytest.mark.parametrize("decode_ms,prefill_us", [(0.9, 170.0), (8.0, 900.0), (2.0, 40.0)])
def test_tier_scenario_sizes_itself_so_the_tiers_are_read(bench_modules, decode_ms, prefill_us):
    """Whatever the CPU's step times, the sized scenario pushes chat prefixes out of the
    small pool while the chats still have turns to come back for them."""
    tier_scenario, _ = bench_modules
    a = tier_scenario.parse_args([])
    m = tier_scenario.Measured(decode_ms / 1000, prefill_us / 1e6, block_bytes=32768)
    sc = tier_scenario.size_scenario(a, m)

    def blocks(tokens: int) -> int:
        return -(-tokens // a.block_size)

    reserve = a.chats + 1
    chat_first = blocks(a.chat_context + a.chat_output)
    chat_final = blocks(a.chat_context + (a.chat_turns - 1) * (a.chat_output + a.chat_user_tokens) + a.chat_output)
    long_prompt = blocks(a.long_prompt)
    small = sc["small_blocks"]
    assert small < sc["everything_blocks"] <= sc["big_blocks"]  # short only for the tiered variants
    assert small - reserve >= long_prompt + 2 * chat_first  # holds the long request plus two chats
    assert small - reserve >= blocks(a.long_prompt + sc["long_output"])  # the long one fits on its own
    assert long_prompt + a.chats * chat_first > small  # its prompt pushes chat prefixes out
    assert sc["everything_blocks"] == blocks(a.long_prompt + sc["long_output"]) + a.chats * chat_final
    # The chats return after the long prompt is in, and the long request arrives as their first turns end.
    est = sc["estimates_s"]
    assert sc["long_delay_s"] > est["chats_first_turns"] >= a.chat_output * m.decode_step_s
    assert est["chats_first_turns"] + sc["think_s"] >= sc["long_delay_s"] + 1.5 * est["long_prefill"]
    assert sc["max_model_len"] >= a.long_prompt + sc["long_output"]
    # Times follow the measurements: a CPU twice as slow thinks twice as long.
    slow = tier_scenario.size_scenario(a, tier_scenario.Measured(2 * m.decode_step_s, 2 * m.prefill_s_per_token, 32768))
    assert slow["think_s"] == pytest.approx(2 * sc["think_s"], rel=1e-3)
    assert slow["small_blocks"] == small and slow["long_output"] == sc["long_output"]
    # CLI values win over derived ones.
    fixed = tier_scenario.parse_args(["--small-blocks", "150", "--think", "0.25", "--long-output", "200"])
    sc = tier_scenario.size_scenario(fixed, m)
    assert (sc["small_blocks"], sc["think_s"], sc["long_output"]) == (150, 0.25, 200)


def _phase(hits: float = 0.0, undecodable: float = 0.0, persisted: float = 0.0, texts=("a", "b"), errors=()) -> dict:
    counters = {"kv_disk_hits": hits, "kv_disk_undecodable": undecodable, "kv_persisted_blocks": persisted}
    return {"ttft_ms": [10.0, 12.0], "texts": list(texts), "errors": list(errors), "counters": counters}


def test_prefix_restart_requires_disk_hits_same_output_and_a_counted_wrong_key(bench_modules):
    prefix_restart = bench_module("prefix_restart")
    a = argparse.Namespace(prefix_tokens=512, prefixes=2)
    good = {
        "save": _phase(persisted=64), "disk": _phase(hits=64), "recompute": _phase(),
        "save_encrypted": _phase(persisted=64), "disk_encrypted": _phase(hits=64),
        "wrong_key": _phase(undecodable=64), "key_a_again": _phase(hits=64),
    }  # fmt: skip
    out = prefix_restart.report(a, good, blocks=64)
    assert out["valid"] and out["ttft_ratio_disk_to_recompute"] == 1.0
    assert out["encrypted"]["restart_with_key_b"]["output_equals_recompute"]
    broken = {
        **good,
        "disk": _phase(hits=0),  # nothing came from disk
        "wrong_key": _phase(hits=3, undecodable=0, texts=("a", "x")),  # the wrong key read blocks
    }
    out = prefix_restart.report(a, broken, blocks=64)
    assert not out["valid"] and out["ttft_ratio_disk_to_recompute"] is None
    reasons = " | ".join(out["invalid_reasons"])
    for expected in ("disk: no disk hit", "wrong_key: output differs", "no undecodable", "a disk hit with the wrong key"):
        assert expected in reasons, reasons
    assert prefix_restart.report(a, {**good, "save": _phase(persisted=10)}, blocks=64)["valid"] is False


def _wave_run(waves: bool, starts: int, tokens: int = 640, p99: float | None = 13.0) -> dict:
    return {"waves": waves, "tokens": tokens, "output_tok_s": 50.0, "gap_p50_ms": 9.0, "gap_p99_ms": p99,
            "steps": {}, "decode_batch_sizes": {}, "wave_starts": starts}


def test_slo_waves_requires_waves_that_formed_and_reports_the_p99_gap_against_the_slo():
    slo_waves = load("slo_waves")
    good = slo_waves.judge(15.0, [_wave_run(True, 12), _wave_run(False, 0, p99=30.0)])
    assert good["valid"] and good["waves_formed"] and good["goal_gap_p99_within_slo"] is True
    assert good["gap_p99_over_slo_waves_worst"] == round(13 / 15, 3)
    over = slo_waves.judge(10.0, [_wave_run(True, 12), _wave_run(False, 0)])
    assert over["valid"] and over["goal_gap_p99_within_slo"] is False  # measured, and missed
    none = slo_waves.judge(15.0, [_wave_run(True, 0), _wave_run(False, 0)])
    assert not none["valid"] and not none["waves_formed"] and none["goal_gap_p99_within_slo"] is None
    assert "no wave formed" in none["invalid_reasons"][0]
    empty = slo_waves.judge(15.0, [_wave_run(True, 3, tokens=0, p99=None)])
    assert not empty["valid"] and "nothing measured" in empty["invalid_reasons"][0]


def _level(**kw) -> dict:
    base = {"streams": 256, "mode": "closed", "requests": 512, "completed": 512, "failed": 0, "paired": 512,
            "stalls_injected": 51, "stalls_found_within_5ms": 51, "client_distorted": False,
            "distortion_reasons": [], "p99_ttft_error_ms": 3.0, "p99_itl_error_ms": 0.5,
            "client_cpu_ms_per_request": 1.0}
    return {**base, **kw}


def test_client_accuracy_requires_complete_paired_undistorted_levels():
    client_accuracy = load("client_accuracy")
    good = client_accuracy.judge([_level()])
    assert good["valid"] and good["goal_256_streams_within_15ms_ttft_2ms_itl"] is True
    for broken, why in ((_level(failed=3, completed=509), "failed"), (_level(paired=500), "truth"),
                        (_level(stalls_injected=0), "no stall"), (_level(client_distorted=True), "distorted")):
        out = client_accuracy.judge([broken])
        assert not out["valid"] and why in " ".join(out["invalid_reasons"]), out
        assert out["goal_256_streams_within_15ms_ttft_2ms_itl"] is None


def test_cpu_gemm_tiles_requires_both_kernels_to_agree():
    tiles = load("cpu_gemm_tiles")
    row = {"n": 576, "k": 576, "rows": 16, "tiled_gfma_s": 40.0, "row_loop_gfma_s": 20.0, "speedup": 2.0}
    assert tiles.judge([{**row, "max_abs_diff": 3e-5}])["valid"]
    wrong = tiles.judge([{**row, "max_abs_diff": 0.7}])  # fast garbage would "win"
    assert not wrong["valid"] and "differ" in wrong["invalid_reasons"][0]


def _disk_round(**kw) -> dict:
    r = {"blocks": 8, "block_bytes": 1 << 20, "bytes": 8 << 20, "tier_checksum_failures": 0}
    for kind in ("write", "read_cold", "read_warm"):
        r[f"tier_{kind}_gbps"], r[f"dd_{kind}_gbps"], r[f"ratio_{kind}"] = 0.9, 1.0, 0.9
    return {**r, **kw}


def test_disk_tier_throughput_requires_clean_checksums_and_measured_rates():
    disk = load("disk_tier_throughput")
    good = disk.summarize([_disk_round(), _disk_round()])
    assert good["valid"] and good["meets_goal"] is True
    corrupt = disk.summarize([_disk_round(), _disk_round(tier_checksum_failures=2)])
    assert not corrupt["valid"] and corrupt["meets_goal"] is None and "checksum" in corrupt["invalid_reasons"][0]
    unmeasured = disk.summarize([_disk_round(tier_write_gbps=float("inf"))])
    assert not unmeasured["valid"] and unmeasured["tier_write_gbps"] is None


def test_fuzz_http_requires_the_cases_sent_and_answered_and_the_engine_checked():
    fuzz = load("fuzz_http")
    out = {"cases": 206, "statuses": {"200": 120, "400": 86}, "problems": 0, "5xx": 0, "dead_engines": 0,
           "plain_checks": 206, "tracebacks_or_errors_in_logs": 0, "servers_alive_after": True,
           "engine_idle_after": True, "block_pool_integrity": "ok"}
    assert fuzz.judge(out, 200, 6) == {"valid": True, "invalid_reasons": [], "goal_no_problem": True}
    assert fuzz.judge({**out, "5xx": 1}, 200, 6)["goal_no_problem"] is False  # a finding, on a valid run
    assert fuzz.judge({**out, "dead_engines": 1}, 200, 6)["goal_no_problem"] is False
    silent = fuzz.judge({**out, "cases": 3, "statuses": {}, "plain_checks": 3}, 200, 6)
    assert not silent["valid"] and len(silent["invalid_reasons"]) == 2 and silent["goal_no_problem"] is None
    unchecked = fuzz.judge({**out, "plain_checks": 100}, 200, 6)  # a stopped engine could pass unseen
    assert not unchecked["valid"] and "checked after" in unchecked["invalid_reasons"][0]


def test_gguf_import_rss_requires_an_import_that_wrote_weights():
    rss = load("gguf_import_rss")
    row = {"dtype": "float32", "seconds": 15.0, "peak_rss_mib": 466.0, "output_mib": 516.5,
           "peak_minus_output_mib": -50.5, "under_output_plus_300mb": True}
    assert rss.judge([row])["goal_under_output_plus_300mb"] is True
    empty = rss.judge([{**row, "output_mib": 0.0}])
    assert not empty["valid"] and empty["goal_under_output_plus_300mb"] is None


def _kv_result(**over) -> dict:
    mem = {"auto": {"bytes_per_token": 1024}, "int8": {"bytes_per_token": 528}, "fp8": {"bytes_per_token": 528}}
    err = {"max_abs": 0.1, "mean_abs": 0.01, "rel_mean": 0.05}
    agree = {"model": "tiny", "by_kv_dtype": {m: {"teacher_forced_agreement": 0.99, "max_logit_diff": 0.1}
                                              for m in ("int8", "fp8")}}
    out = {"memory": {"tiny_fp32": mem}, "attention_error": [{"context": 2048, "mode": m, **err} for m in ("int8", "fp8")],
           "model_attention_error": [{"context": 1024, "mode": "int8", **err}], "agreement": [agree]}
    return {**out, **over}


def test_kv_quant_quality_requires_a_quantized_pool_and_measured_errors():
    kv = load("kv_quant_quality")
    assert kv.judge(_kv_result())["valid"]
    zero = {"max_abs": 0.0, "mean_abs": 0.0, "rel_mean": 0.0}  # the "int8" pool was fp32 after all
    broken = kv.judge(_kv_result(model_attention_error=[{"context": 1024, "mode": "int8", **zero}]))
    assert not broken["valid"] and "not quantized" in broken["invalid_reasons"][0]
    same = {"auto": {"bytes_per_token": 1024}, "int8": {"bytes_per_token": 1024}, "fp8": {"bytes_per_token": 528}}
    assert not kv.judge(_kv_result(memory={"tiny_fp32": same}))["valid"]


def _phases(oversized, module):
    quiet, flood = module.Phase("quiet"), module.Phase("flood")
    for p in (quiet, flood):
        p.gaps, p.health, p.rss = [0.01] * 50, [0.002] * 20, [100 << 20] * 5
    flood.oversized = oversized
    return [quiet, flood]


def test_oversized_requests_requires_every_oversized_request_refused():
    oversized = load("oversized_requests")
    args = argparse.Namespace(model="tiny")
    refused = [{"status": 413, "answer_ms": 3.0}] * 3
    good = oversized._report(args, _phases(refused, oversized))
    assert good["valid"] and good["goals_met"] is True
    accepted = oversized._report(args, _phases(refused + [{"status": 200, "answer_ms": 900.0}], oversized))
    assert not accepted["valid"] and "not refused" in accepted["invalid_reasons"][0]
    unanswered = oversized._report(args, _phases([{"status": None, "error": "ServerDisconnectedError",
                                                   "answer_ms": 5.0}], oversized))
    assert not unanswered["valid"]


def test_slow_headers_gate_requires_an_attack_that_lasted_and_408s_from_the_gate():
    slow = load("slow_headers_gate")
    out = {"quiet": {"n": 40}, "attack": {"n": 40, "all_sockets_still_open": True},
           "ttft_ratio_p50": 0.99, "ttft_ratio_p99": 1.1,
           "slow_sockets": {"n": 500, "closed_after_s_min": 10.0, "closed_after_s_max": 10.4,
                            "answers": ["HTTP/1.1 408"]}}
    assert slow.judge(out, 500, 10.0)["goal_closed_at_header_timeout"] is True
    early = slow.judge({**out, "attack": {"n": 40, "all_sockets_still_open": False}}, 500, 10.0)
    assert not early["valid"] and early["goal_ttft_within_1_2x"] is None
    reset = slow.judge({**out, "slow_sockets": {**out["slow_sockets"], "answers": ["ConnectionResetError"]}},
                       500, 10.0)
    assert not reset["valid"] and "408" in reset["invalid_reasons"][0]


def test_tokenizer_offloop_requires_every_mode_to_encode_the_same_tokens():
    tok = load("tokenizer_offloop")
    mode = {"encode_ms_mean": 50.0, "loop_gap_ms_max": 2.0, "ticks": 300, "tokens": 4000, "digest": 7}
    out = {m: dict(mode) for m in tok.MODES}
    assert tok.judge(out)["valid"]
    out["process"] = {**mode, "tokens": 0, "digest": 0}  # a worker that returned nothing: fast and wrong
    bad = tok.judge(out)
    assert not bad["valid"] and "process" in bad["invalid_reasons"][0]


def _fleet_variant(**kw) -> dict:
    v = {"errors": [], "prompt_tokens": 9000, "routed_by_reason": {"prefix_hit": 30}, "prefix_cache_query_tokens": 9000,
         "median_ttft_ms": 500.0, "p99_ttft_ms": 900.0, "median_followup_ttft_ms": 400.0,
         "p99_followup_ttft_ms": 800.0, "prefix_cache_hit_rate": 0.7}
    return {**v, **kw}


def test_fleet_prefix_routing_requires_both_variants_clean_and_prefix_routing_used():
    fleet = load("fleet_prefix_routing")
    good = fleet.judge({"variants": {"prefix": _fleet_variant(), "round-robin": _fleet_variant(
        routed_by_reason={}, prefix_cache_hit_rate=0.5)}})
    assert good["valid"] and good["goal_prefix_hit_rate_above_round_robin"] is True
    broken = fleet.judge({"variants": {"prefix": _fleet_variant(routed_by_reason={"load": 30}),
                                       "round-robin": _fleet_variant(errors=["HTTP 500: boom"])}})
    assert not broken["valid"] and broken["goal_prefix_hit_rate_above_round_robin"] is None
    assert "HTTP 500" in " ".join(broken["invalid_reasons"]) and "no turn by prefix" in " ".join(broken["invalid_reasons"])


def test_fleet_shared_limits_requires_an_overload_a_held_slot_and_its_return():
    shared = load("fleet_shared_limits")
    a = argparse.Namespace(limit=8, lease_ms=2000, slack_ms=100, seconds=8.0)
    ok = {"status": 200, "complete": True, "sent": 1.0}
    r = {"results": [(1, ok), (1, {"status": 429, "sent": 5.0}), (0, ok)], "killed_at": 4.0, "start": 0.0,
         "samples": [(1.0, 8), (6.0, 8)], "held_by_killed_gate": 3, "slots_back_s": 1.9, "rate_rps": 10.0,
         "capacity_rps": 2.5, "upstream": {"max_active": 8}, "upstream_low_after_kill": 5, "survivor": {}}
    good = shared.report(a, r)
    assert good["valid"] and good["goal_slots_back_within_lease_plus_slack"] is True
    broken = shared.report(a, {**r, "held_by_killed_gate": 0, "slots_back_s": None,
                               "results": [(1, {"status": 500, "sent": 5.0})]})
    assert not broken["valid"] and len(broken["invalid_reasons"]) == 4
    assert broken["goal_upstream_never_above_limit"] is None


def test_gate_overhead_requires_every_stream_delivered_and_paired():
    overhead = load("gate_overhead")
    pooled = {m: {"ttft": [0.02] * 6} for m in ("direct", "gate", "direct_b")}
    run = overhead.Validity()
    overhead.judge_level(run, 3, 2, dict.fromkeys(pooled, 0), pooled)
    assert run.valid
    pooled["gate"]["ttft"] = [0.02] * 4  # two gate streams never delivered a chunk
    overhead.judge_level(run, 3, 2, {"direct": 0, "gate": 1, "direct_b": 0}, pooled)
    assert not run.valid and len(run.reasons) == 2


def test_gate_overload_requires_an_overload_with_complete_streams():
    overload = load("gate_overload")
    v = overload.Validity()
    overload._check([{"status": 200, "complete": True}, {"status": 429}], v, "measured")
    assert v.valid
    overload._check([{"status": 200, "complete": False}, {"status": 502}, RuntimeError("reset")], v, "measured")
    assert not v.valid and len(v.reasons) == 4  # raised, odd status, cut short, no 429


def test_remote_tier_requires_remote_hits_and_a_degraded_health_after_the_kill():
    remote = load("remote_tier")
    a = argparse.Namespace(prefixes=2, kill_requests=1, prefix_tokens=512)
    per = 512 // 16
    got = {"errors": [], "a": {"kv_remote_writes": 4 * per}, "b_known_blocks_before": 4 * per,
           "b_measured": {"kv_remote_hits": 2 * per, "kv_tier_recomputes": 0},
           "health_before_kill": "ok", "kill": {"health_after_kill": "degraded",
                                                "counter_deltas": {"kv_contract_interactive_recompute": 1}},
           "remote_ttft_ms": [100.0, 120.0], "recompute_ttft_ms": [1200.0, 1180.0]}
    good = remote.report(a, got)
    assert good["valid"] and good["goal_ratio_below_0_5"] is True
    missed = remote.report(a, {**got, "b_measured": {"kv_remote_hits": 0, "kv_tier_recomputes": 2},
                               "kill": {"health_after_kill": "ok", "counter_deltas": {"kv_contract_interactive_recompute": 0}}})
    assert not missed["valid"] and missed["ttft_ratio_remote_to_recompute"] is None and len(missed["invalid_reasons"]) == 4


def test_serve_vs_transformers_requires_every_stream_to_deliver_what_was_asked():
    svt = load("serve_vs_transformers")
    good = svt.Stream(0.0, events=[0.1], text=["hi"], completion_tokens=64)
    assert svt.judge_streams([good, good], 64).valid
    failed = svt.Stream(0.0, error="HTTP 500")
    short = svt.Stream(0.0, events=[0.1], text=["hi"], completion_tokens=10)
    v = svt.judge_streams([good, failed, short], 64)
    assert not v.valid and len(v.reasons) == 2


def test_weight_quant_quality_requires_quantized_weights_and_scored_positions():
    wq = load("weight_quant_quality")
    report = {"texts": ["GPL-3"], "positions_per_text": 256,
              "int8": {"bytes_vs_float32": 0.27, "agreement": 0.994}, "int4": {"bytes_vs_float32": 0.19, "agreement": 0.93}}
    good = wq.judge({k: (dict(v) if isinstance(v, dict) else v) for k, v in report.items()})
    assert good["valid"] and good["int8"]["meets_target"] is True and good["int4"]["meets_target"] is True
    floats = wq.judge({**report, "int8": {"bytes_vs_float32": 1.0, "agreement": 1.0}})  # never quantized
    assert not floats["valid"] and floats["int8"]["meets_target"] is None
    bf16 = wq.judge({**report, "bf16": {"bytes_vs_float32": 0.5, "agreement": 0.99}})
    assert bf16["valid"] and bf16["bf16"]["meets_target"] is True
    wide = wq.judge({**report, "bf16": {"bytes_vs_float32": 1.0, "agreement": 1.0}})  # float32 kept
    assert not wide["valid"]


def test_weight_dtype_speed_requires_each_kind_its_weights_and_the_fused_step():
    ws = load("weight_dtype_speed")

    def kind(ratio):
        return {"bytes_vs_float32": ratio, "fused_steps": 40, "short_batches": 0}

    good = ws.judge({"kinds": {"auto": kind(1.0), "bf16": kind(0.5), "int8": kind(0.27)}})
    assert good["valid"], good["invalid_reasons"]
    assert not ws.judge({"kinds": {"auto": kind(1.0), "bf16": kind(1.0), "int8": kind(0.27)}})["valid"]
    unfused = ws.judge({"kinds": {"auto": kind(1.0), "bf16": {**kind(0.5), "fused_steps": 0}, "int8": kind(0.27)}})
    assert not unfused["valid"] and "fused step" in " ".join(unfused["invalid_reasons"])
    short = ws.judge({"kinds": {"auto": {**kind(1.0), "short_batches": 1}, "bf16": kind(0.5), "int8": kind(0.27)}})
    assert not short["valid"]
    assert not ws.judge({"kinds": {"auto": kind(1.0)}})["valid"]  # a kind missing
