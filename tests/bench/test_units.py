"""Pure pieces: arrivals, limiter, datasets, per-token timing, statistics, SLOs, topology."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from tierguard.bench import topo
from tierguard.bench.backend import resolve_token_counts
from tierguard.bench.config import BenchConfig, parse_slo, parse_window
from tierguard.bench.datasets import build_requests
from tierguard.bench.prompts import PromptMaker, TokenizerPrompts
from tierguard.bench.records import RequestRecord
from tierguard.bench.stats import describe, meets_slo
from tierguard.bench.strategy import ConcurrencyLimiter, GammaArrivals, ImmediateArrivals, TraceArrivals
from tierguard.common.errors import TierguardError


def test_poisson_and_gamma_keep_the_mean_rate_and_burstiness_sets_variability():
    poisson = np.diff(GammaArrivals(20.0, 1.0, seed=1).schedule(4000))
    bursty = np.diff(GammaArrivals(20.0, 0.25, seed=1).schedule(4000))
    assert np.mean(poisson) == pytest.approx(0.05, rel=0.06)
    assert np.mean(bursty) == pytest.approx(0.05, rel=0.12)
    cv = lambda x: np.std(x) / np.mean(x)  # noqa: E731
    assert cv(poisson) == pytest.approx(1.0, rel=0.1) and cv(bursty) > 1.7
    assert GammaArrivals(5, 1, seed=3).schedule(50) == GammaArrivals(5, 1, seed=3).schedule(50)
    assert ImmediateArrivals().schedule(3) == [0.0, 0.0, 0.0]
    assert max(GammaArrivals(10, 1, seed=0).schedule(duration_s=2.0)) < 2.0
    assert TraceArrivals([2.0, 0.0, 1.0]).schedule() == [0.0, 1.0, 2.0]


def test_limiter_bounds_in_flight_and_measures_wait():
    hold = 0.02

    async def go():
        lim = ConcurrencyLimiter(2)
        peak = 0

        async def job():
            nonlocal peak
            waited = await lim.acquire()
            peak = max(peak, lim.in_flight)
            await asyncio.sleep(hold)
            lim.release()
            return waited

        waits = await asyncio.gather(*[job() for _ in range(6)])
        return peak, waits

    peak, waits = asyncio.run(go())
    # Six jobs through two slots run in three waves: wave k waited at least k holds (a sleep
    # never ends early), and the first wave found free slots (waited less than any later one).
    assert peak == 2
    first, second, third = waits[0:2], waits[2:4], waits[4:6]
    assert min(second) >= hold * 0.999 and min(third) >= 2 * hold * 0.999
    assert max(first) < min(second)


def test_per_token_itl_divides_chunk_gaps_and_stall_is_excess_over_cadence():
    r = RequestRecord(index=0, status="ok", scheduled_s=0.0, first_token_s=0.1, end_s=0.1 + 0.08 * 3 + 0.5,
                      chunk_times_s=[0.1, 0.18, 0.26 + 0.5, 0.34 + 0.5], chunk_tokens=[4, 4, 4, 4], output_tokens=16)
    itl = r.itl_samples_ms()
    assert len(itl) == 12 and np.allclose(sorted(itl)[:8], 20.0)  # 4 tokens per 80 ms chunk = 20 ms/token
    assert itl.sum() == pytest.approx(r.e2el_ms - r.ttft_ms)  # samples sum to E2EL − TTFT
    assert r.stall_ms == pytest.approx(500.0)
    assert r.max_gap_ms == pytest.approx(580.0)
    assert r.tpot_ms == pytest.approx((0.84 - 0.1) * 1000 / 15)


def test_token_counts_resolved_from_usage_total_or_chunk_count():
    r = RequestRecord(index=0, status="ok", chunk_times_s=[0.1, 0.2, 0.3], chunk_tokens=[0, 0, 0])
    r._texts, r._usage_total = [b"a", b"bb bb", b"c"], 5
    resolve_token_counts(r)
    assert r.token_count_source == "usage_total" and sum(r.chunk_tokens) == 5 and r.chunk_tokens[1] >= 2
    r2 = RequestRecord(index=0, status="ok", chunk_times_s=[0.1, 0.2], chunk_tokens=[0, 0])
    r2._texts = [b"x", b"y"]
    resolve_token_counts(r2)
    assert r2.token_count_source == "chunk_count" and r2.chunk_tokens == [1, 1]


def test_describe_keys_and_values():
    d = describe(range(1, 1001), "ttft_ms")
    assert d["median_ttft_ms"] == pytest.approx(500.5) and d["max_ttft_ms"] == 1000
    assert d["p999_ttft_ms"] > d["p99_ttft_ms"] > d["p95_ttft_ms"] > d["p90_ttft_ms"]
    assert describe([], "x")["p99_x"] is None


def test_slo_checks_worst_token_and_failures_miss():
    ok = RequestRecord(index=0, status="ok", scheduled_s=0, first_token_s=0.1, end_s=0.5,
                       chunk_times_s=[0.1, 0.12, 0.5], chunk_tokens=[1, 1, 1], output_tokens=3)
    assert meets_slo(ok, parse_slo("ttft=200"))
    assert not meets_slo(ok, parse_slo("itl=100"))  # the 380 ms gap is a miss even if the mean is fine
    assert not meets_slo(RequestRecord(index=1, status="timeout"), parse_slo("ttft=1e9"))
    assert parse_slo("ttft=500ms,e2el=2000").e2el_ms == 2000
    for bad in ("ttft", "foo=3", "ttft=-1", "itl=abc"):
        with pytest.raises(TierguardError):
            parse_slo(bad)
    assert parse_window("5s", "w").seconds == 5 and parse_window("7", "w").requests == 7


def test_datasets_have_exact_lengths_with_a_tokenizer(word_tokenizer, tmp_path):
    maker = TokenizerPrompts(word_tokenizer)
    cfg = BenchConfig(input_len=40, output_len=8, range_ratio=0.5, seed=2)
    reqs = build_requests(cfg, maker, 30)
    assert all(maker.count(r.prompt) == r.input_len for r in reqs)
    assert len({r.input_len for r in reqs}) > 5 and all(20 <= r.input_len <= 60 for r in reqs)
    assert len({r.prompt for r in reqs}) == 30

    mixed = build_requests(BenchConfig(dataset="mixed", input_len=16, long_input_len=200, long_share=0.1), maker, 40)
    assert sum(r.group == "long" for r in mixed) == 4 and {r.input_len for r in mixed} == {16, 200}

    sp = build_requests(BenchConfig(dataset="shared-prefix", num_prefixes=3, requests_per_prefix=4, prefix_len=30,
                                    input_len=10), maker, 0)
    assert len(sp) == 12 and all(r.input_len == 40 for r in sp)
    same = [r.prompt for r in sp if r.group == "prefix-1"]
    assert len({p[: len(same[0]) // 2] for p in same}) == 1 and len(set(same)) == 4

    ss = build_requests(BenchConfig(dataset="sessions", num_sessions=2, turns=3, input_len=10, output_len=5), maker, 0)
    s0 = [r for r in ss if r.group.startswith("session-0/")]
    assert [r.input_len for r in s0] == [10, 25, 40]  # history grows by output + next message
    assert s0[2].prompt.startswith(s0[1].prompt[:20])

    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": t, "input_length": 12, "output_length": 3})
                               for t in (1000, 1500, 3000)))
    tr = build_requests(BenchConfig(dataset="trace", trace=str(trace)), maker, 0)
    assert [r.arrival_s for r in tr] == [0.0, 0.5, 2.0] and {r.input_len for r in tr} == {12}
    trace.write_text('{"oops": 1}\n')
    with pytest.raises(TierguardError, match="t.jsonl:1"):
        build_requests(BenchConfig(dataset="trace", trace=str(trace)), maker, 0)


def test_approximate_prompts_are_marked():
    maker = PromptMaker()
    assert maker.exact is False and maker.source == "approximate"
    text, _ = maker.text_of_length(25, np.random.default_rng(0))
    assert maker.count(text) == 25


def test_topology_without_gpu_lists_what_is_missing():
    t = topo.collect(with_captures=True)
    assert set(t) >= {"gpus", "nvme", "numa_nodes", "binding", "mismatches", "captures", "missing"}
    assert t["binding"]["cpus"]
    if not t["gpus"]:
        assert any("GPU" in m for m in t["missing"])
    assert topo.parse_cpulist("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]


def test_topology_mismatch_flags():
    t = {"numa_nodes": {0: [0, 1], 1: [2, 3]}, "binding": {"cpus": [0, 1], "mems_allowed": [0]},
         "gpus": [{"index": 0, "numa_node": 1, "link_width": 8, "max_link_width": 16, "pcie_gen": 4, "max_pcie_gen": 4}],
         "nvme": []}
    flags = topo.mismatches(t)
    assert any("NUMA node 1" in f and "runs on" in f for f in flags)
    assert any("memory is bound" in f for f in flags)
    assert any("x8 below" in f for f in flags)


def test_topo_cli_json_and_output(tmp_path, capsys):
    from tierguard.cli.main import main

    assert main(["topo", "--json", "--no-bandwidth", "--output", str(tmp_path / "t.json")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["binding"] == json.loads((tmp_path / "t.json").read_text())["binding"]
    assert main(["topo", "--no-bandwidth"]) == 0
    shown = capsys.readouterr().out
    assert "process binding" in shown and ("missing" in shown or "GPU" in shown)


def test_self_check_flags_distortion_with_reasons():
    from tierguard.bench.selfcheck import WorkerHealth, assess

    calm = assess([WorkerHealth(0, cpu_s=0.5, wall_s=10, loop_lag_ms=[0.2] * 100)], [0.5] * 50, 50, 10, 10, 0.9)
    assert calm["client_distorted"] is False and calm["client_cpu_ms_per_request"] == pytest.approx(10.0)
    busy = assess([WorkerHealth(0, cpu_s=9.8, wall_s=10, loop_lag_ms=[40.0] * 100)], [30.0] * 50, 50, 10, 10, 0.9)
    assert busy["client_distorted"] is True and len(busy["distortion_reasons"]) == 3


def test_metrics_text_is_parsed_without_buckets():
    from tierguard.bench.scrape import parse_metrics

    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 3.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.75\n'
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 4.0\n'
        'vllm:time_to_first_token_seconds_count{model_name="m"} 4.0\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.9\n'
    )
    m = parse_metrics(text)
    assert m['vllm:num_requests_waiting{model_name="m"}'] == 3.0
    assert m['vllm:kv_cache_usage_perc{model_name="m"}'] == 0.75
    assert not any("_bucket" in k for k in m) and any(k.startswith("vllm:time_to_first_token_seconds_count") for k in m)


def test_schedule_server_chunks_are_valid_json():
    import urllib.request

    from tierguard.bench.schedule_server import ScheduleServer

    with ScheduleServer(ttft_ms=1, itl_ms=1, tokens_per_chunk=3) as s:
        for ep in ("/v1/completions", "/v1/chat/completions"):
            body = json.dumps({"model": "m", "prompt": "a b", "messages": [{"role": "user", "content": "x"}],
                               "max_tokens": 7, "stream": True,
                               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()
            req = urllib.request.Request(s.base_url + ep, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                events = [e[6:] for e in r.read().decode().split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert [c["usage"]["completion_tokens"] for c in chunks] == [3, 6, 7, 7]
            assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
