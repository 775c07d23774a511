"""Calibration's pieces: the step log a served engine writes, the fit on it, the
black-box fit and policies of external engines, command rewriting."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tierguard.bench.records import OK, RequestRecord
from tierguard.engine.api import SamplingParams, StepShape
from tierguard.engine.config import EngineConfig
from tierguard.predict.calibrate import ProbeRun, client_timing, fit_black_box
from tierguard.predict.engines import Policy, classify, compute_probe_argv, external_policy
from tierguard.predict.predictor import generic_spec
from tierguard.serve.step_log import StepLog, read_step_log
from tierguard.sweep.matrix import Variant


def test_step_log_records_each_step_shape_as_the_scheduler_ran_it(tiny_dir, tmp_path):
    from tierguard.engine.llm_engine import LLMEngine
    from tierguard.model.loader import load_model
    from tierguard.model.tokenizer import HFTokenizer

    model, cfg, dtype, device = load_model(tiny_dir, "float32", "cpu")
    config = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
    engine = LLMEngine(model, cfg, HFTokenizer(tiny_dir), config, dtype, device, model_name="t")
    log = StepLog(tmp_path / "steps.jsonl", engine)
    engine.add_step_listener(log)
    engine.generate([[5] * 10, [6] * 20], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    log.close()
    header, steps = read_step_log(tmp_path / "steps.jsonl")
    assert header["engine_config"]["num_blocks"] == 64 and header["kv_layout"]["block_size"] == 4
    # step 1: 16 tokens: the first prompt whole (10) and 6 of the second
    assert (steps[0]["chunks"], steps[0]["chunk_tokens"], steps[0]["chunk_keys"]) == (2, 16, 55 + 21)
    assert steps[0]["sampled"] == 1
    # then the second prompt's other 14 tokens (positions 6..19) beside one decode at context 11
    assert (steps[1]["token_rows"], steps[1]["token_row_keys"], steps[1]["chunk_tokens"]) == (1, 11, 14)
    assert steps[1]["chunk_keys"] == sum(range(7, 21))
    assert sum(s["sampled"] for s in steps) == 6  # 2 requests x 3 tokens
    assert all(b["started"] >= a["started"] + a["duration"] for a, b in zip(steps, steps[1:], strict=False))


def test_client_latencies_come_from_matching_steps_with_tokens():
    # steps end at 10.010, 10.020, 10.030; the client sent at 9.995 and saw tokens 2 ms after each step
    steps = [{"started": 10.0 + 0.01 * i, "duration": 0.01} for i in range(3)]
    rec = RequestRecord(0, sent_s=-0.005, scheduled_s=-0.005, chunk_times_s=[0.012, 0.022, 0.032], status=OK)
    run = ProbeRun("single", 16, 1, 10.0, 9.995, 10.04, [rec])
    t = client_timing(steps, [run])
    assert t.send_s == pytest.approx(0.005) and t.deliver_s == pytest.approx(0.002)


def synthetic_runs(policy: Policy, a=0.008, b=0.002, c=1e-6, pf=0.01, p1=0.0004, lag=0.02) -> list[ProbeRun]:
    """Client records of an engine whose decode step is a + b n + c keys and whose
    prefill chunk costs a + pf + p1 k (keys ignored), as seen by a bench client."""
    runs, rng = [], np.random.default_rng(0)
    for phase, ctx, conc in [("single", 16, 1), ("single", 128, 1), ("single", 512, 1), ("single", 1024, 1),
                             ("ramp", 512, 2), ("ramp", 512, 4), ("ramp", 512, 8)]:
        n = min(conc, policy.max_num_seqs)
        step = a + b * n + c * n * (ctx + 8)
        recs = []
        for _ in range(2):
            chunks = -(-ctx // policy.max_num_batched_tokens)
            ttft = lag + chunks * (a + pf) + p1 * ctx
            times = [ttft + step * (i + 1) * float(np.exp(rng.normal(0, 0.01))) for i in range(16)]
            times = [ttft] + sorted(times)
            recs.append(RequestRecord(0, input_len=ctx, prompt_tokens=ctx, scheduled_s=0.0, first_token_s=ttft,
                                      chunk_times_s=times, chunk_tokens=[1] * len(times), output_tokens=len(times),
                                      status=OK, end_s=times[-1]))
        runs.append(ProbeRun(phase, ctx, conc, 0.0, 0.0, 1.0, recs))
    return runs


def test_black_box_fit_recovers_decode_and_prefill_costs():
    policy = Policy(max_num_seqs=128, max_num_batched_tokens=256)
    cost, client, band = fit_black_box(synthetic_runs(policy), policy)
    a0, a1, a2 = cost.regimes["decode"].coef
    assert a0 == pytest.approx(0.008, rel=0.1) and a1 == pytest.approx(0.002, rel=0.1)
    assert client.send_s == pytest.approx(0.02, abs=0.004)
    prefill = StepShape(chunks=1, chunk_tokens=256, chunk_keys=256 * 257 // 2, sampled=0)
    assert cost.step_seconds(prefill) == pytest.approx(0.008 + 0.01 + 0.0004 * 256, rel=0.15)
    assert 0.05 <= band <= 0.5


def test_a_serial_server_is_fitted_at_one_stream_whatever_the_client_sends():
    policy = Policy(max_num_seqs=1, max_num_batched_tokens=512)
    cost, _client, _band = fit_black_box(synthetic_runs(policy), policy)
    one = StepShape(token_rows=1, token_row_keys=520, sampled=1)
    assert cost.step_seconds(one) == pytest.approx(0.008 + 0.002 + 520e-6, rel=0.1)


def test_policies_from_flags_and_logs():
    vllm = classify(Variant(name="v", command=".venv-vllm/bin/python -m vllm.entrypoints.openai.api_server "
                            "--model m --port {port} --max-model-len 1024 --max-num-seqs 8 --no-enable-prefix-caching"))
    p = external_policy(vllm, "INFO Chunked prefill is enabled with max_num_batched_tokens=2048.\n"
                        "INFO CPU KV cache size: 23,296 tokens, Maximum concurrency ...")
    assert (p.max_num_seqs, p.max_num_batched_tokens, p.kv_tokens, p.block_size) == (8, 2048, 23296, 128)
    assert not p.prefix_caching and p.max_model_len == 1024 and p.sources["kv_tokens"] == "log"
    spec = generic_spec(p, "v")
    assert spec.config.num_blocks == 23296 // 128 and spec.config.max_num_seqs == 8
    llama = classify(Variant(name="l", command="py -m llama_cpp.server --model x.gguf --port {port} --n_ctx 2048"))
    q = external_policy(llama)
    assert (q.max_num_seqs, q.max_num_batched_tokens, q.kv_tokens) == (1, 512, 2048)
    other = classify(Variant(name="o", base_url="http://127.0.0.1:9"))
    assert other.kind == "openai"


def test_the_compute_probe_drops_the_kv_budget_and_keeps_the_tiers():
    # the tiers' write-behind slows the steps it overlaps: the probe must run with it
    v = Variant(name="n", command="{python} -m tierguard serve --model tiny --port {port} --kv-cache-gib 0.006 "
                "--kv-dtype fp8 --kv-host-gib 0.25 --kv-disk-dir {workdir}/d --kv-disk-gib=1 --kv-naive-sync-disk "
                "--target-itl-ms 50")
    argv = compute_probe_argv(classify(v))
    tail = argv[argv.index("serve") + 1:]
    assert tail == ["--model", "tiny", "--kv-dtype", "fp8", "--kv-host-gib", "0.25", "--kv-disk-dir",
                    "{workdir}/d", "--kv-disk-gib=1", "--kv-naive-sync-disk", "--target-itl-ms", "50",
                    "--port", "{port}", "--step-log", "{workdir}/steps.jsonl"]
    assert json.dumps(argv)  # plain strings


def test_the_step_log_fit_measures_how_successive_steps_move_together():
    # decode steps whose slowness persists (an AR(1) in log time), a few prefill chunks
    # among them: the fit keeps the lag-1 correlation for the simulation to replay
    from tierguard.predict.calibrate import fit_step_log

    rng, z, t, steps = np.random.default_rng(2), 0.0, 100.0, []
    for i in range(800):
        z = 0.8 * z + 0.6 * rng.normal()
        rows = 1 + i % 8
        chunk = 64 if i % 20 == 0 else 0
        d = (1.0 + 0.4 * rows + 0.05 * chunk) / 1e3 * float(np.exp(0.3 * z))
        steps.append({"started": t, "duration": d, "token_rows": rows, "token_row_keys": rows * 200,
                      "chunks": int(chunk > 0), "chunk_tokens": chunk, "chunk_keys": chunk * 100, "sampled": rows})
        t += d + 1e-4
    runs = [ProbeRun("ramp", 512, 8, 100.0, 100.0, t, [])]
    cost, _client, _band = fit_step_log({"fused_max_rows": 0}, steps, runs)
    assert 0.6 < cost.rho < 0.95
    shuffled = [dict(s, started=100.0 + k) for k, s in enumerate(rng.permutation(steps))]
    assert fit_step_log({"fused_max_rows": 0}, shuffled, [ProbeRun("ramp", 512, 8, 100.0, 100.0, 1e4, [])])[0].rho < 0.15


def test_delivery_probes_feed_the_client_latencies_and_stay_out_of_the_step_fit():
    from tierguard.predict.calibrate import ProbePlan, fit_step_log, probe_jobs
    from tierguard.sweep.matrix import parse_matrix

    m = parse_matrix({"name": "p", "variants": [{"name": "x", "base_url": "http://127.0.0.1:1"}],
                      "profile": {"context_lengths": [1024], "output_len": 32}, "slo": {"p99_ttft_ms": 1, "p99_itl_ms": 1}})
    plan = ProbePlan.for_matrix(m, 1088)
    delivery = [j for j in probe_jobs(plan) if j[0] == "delivery"]
    assert delivery == [("delivery", 128, 1, 4, 128)]
    assert ProbePlan.for_matrix(m, 100).delivery_output_len == 84  # what the model length leaves
    # ramp steps of 2 ms, then a delivery request whose steps are 50 ms: the fit must not
    # see them, the client's latencies must
    steps, t = [], 100.0
    for _ in range(40):
        steps.append({"started": t, "duration": 0.002, "token_rows": 2, "token_row_keys": 400, "chunks": 0,
                      "chunk_tokens": 0, "chunk_keys": 0, "sampled": 2})
        t += 0.0021
    for i in range(5):
        steps.append({"started": t, "duration": 0.02, "token_rows": 0, "token_row_keys": 0, "chunks": 1,
                      "chunk_tokens": 64 + i, "chunk_keys": 64 * 64, "sampled": 0})
        t += 0.0201
    ramp_end, dstart = t, t + 0.01
    t = dstart + 0.001
    made = []
    for _ in range(6):
        steps.append({"started": t, "duration": 0.05, "token_rows": 1, "token_row_keys": 100, "chunks": 0,
                      "chunk_tokens": 0, "chunk_keys": 0, "sampled": 1})
        made.append(t + 0.05)
        t += 0.051
    rec = RequestRecord(0, sent_s=0.0, scheduled_s=0.0, chunk_times_s=[x + 0.003 - dstart for x in made],
                        chunk_tokens=[1] * 6, status=OK)
    runs = [ProbeRun("ramp", 512, 2, 100.0, 100.0, ramp_end, []), ProbeRun("delivery", 128, 1, dstart, dstart, t, [rec])]
    cost, client, _band = fit_step_log({"fused_max_rows": 0}, steps, runs)
    one = StepShape(token_rows=1, token_row_keys=100, sampled=1)
    assert cost.step_seconds(one) < 0.01  # the 50 ms steps were left out
    assert client.deliver_samples_s == pytest.approx([0.003] * 5)
