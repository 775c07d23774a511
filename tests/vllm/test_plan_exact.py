"""`tierguard plan --engine vllm --target cpu` against the line vLLM itself logs at start-up.

"CPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx" must
match the plan exactly: on SmolLM2 (float32 and bfloat16, served by `vllm serve` with the
plan's env and flags) and on tiny models of other shapes (GQA 1, 2 and 4, MQA, head_dim
80 and 256, odd layer counts, KV per token not a power of two, a bfloat16 checkpoint,
float16, fp8 KV where the CPU has AVX-512 or AMX, an explicit block size, a pool given in
bytes, a max_model_len that is not a whole number of blocks), each built as a real engine
from the same flags.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.vllm.conftest import ROOT, plan_json, vllm_peer
from tierguard.cli.main import main as tierguard_main
from tierguard.plan.vllm_cpu import cpu_holds_fp8_kv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # vLLM start-ups take minutes on a busy machine


def _check(plan: dict, logged: dict | None) -> None:
    fig = plan["vllm_cpu"]
    assert logged is not None, "vLLM logged no KV cache size line"
    assert logged["pool"] == "CPU"
    assert (logged["tokens"], logged["max_model_len"], logged["concurrency"]) == (
        fig["kv_cache_tokens"], fig["max_model_len"], f"{fig['max_concurrency']:.2f}"
    )
    assert logged["line"] == fig["log_line"]


def test_smollm2_plan_matches_what_vllm_serve_logs(replicas):
    for r in replicas:
        _check(r.plan, r.kv_line)
        assert r.plan["vllm_cpu"]["dtype"] == r.dtype
    f32, bf16 = (r.plan["vllm_cpu"] for r in replicas)
    assert f32["bytes_per_token"] == 30 * 3 * 64 * 2 * 4 == 2 * bf16["bytes_per_token"]
    assert f32["kv_cache_tokens"] < bf16["kv_cache_tokens"]


# name: create-tiny flags; plan flags (the pool and dtype choices vary too)
SHAPES = {
    "mha-hd32-l3": (["--layers", "3", "--hidden", "256", "--heads", "8", "--kv-heads", "8"],
                    ["--kv-cache-gib", "1"]),
    "mqa-hd256-l2": (["--layers", "2", "--hidden", "1024", "--heads", "4", "--kv-heads", "1"],
                     ["--kv-cache-gib", "0.3", "--dtype", "float32", "--max-model-len", "1000"]),
    "gqa2-hd80-l5": (["--layers", "5", "--hidden", "480", "--heads", "6", "--kv-heads", "3"],
                     ["--kv-cache-gib", "1", "--dtype", "bfloat16", "--block-size", "64"]),
    "gqa4-bf16-l4": (["--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "2", "--dtype", "bfloat16"],
                     ["--kv-cache-gib", "2"]),
    "gqa3-hd96-f16": (["--layers", "7", "--hidden", "576", "--heads", "6", "--kv-heads", "2"],
                      ["--kv-cache-gib", "1", "--dtype", "float16", "--max-model-len", "1500"]),
}


# vLLM's CPU attention keeps an fp8 KV cache only with AVX-512 or AMX (elsewhere it refuses
# to start), so the fp8 shape is built where the CPU can hold it.
if cpu_holds_fp8_kv():
    SHAPES["gqa3-hd96-fp8"] = (["--layers", "7", "--hidden", "576", "--heads", "6", "--kv-heads", "2"],
                               ["--kv-cache-gib", "1", "--dtype", "float16", "--max-model-len", "1500",
                                "--kv-dtype", "fp8"])


def test_tiny_shapes_plan_matches_the_engine_vllm_builds(vllm_venv, tmp_path):
    cases, plans = [], {}
    for name, (shape, plan_args) in SHAPES.items():
        d = tmp_path / name
        assert tierguard_main(["model", "create-tiny", str(d), "--vocab", "512",
                               "--max-position-embeddings", "2048", *shape]) == 0
        plan = plan_json(d, *plan_args)
        plans[name] = plan
        cases.append({"model": str(d), "env": plan["env"], "flags": plan["flags"]["vllm"]})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = subprocess.run([str(vllm_venv), str(ROOT / "tests" / "vllm" / "kv_probe.py"), str(tmp_path / "cases.json")],
                         capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    per_case = re.split(r"^@@case (\d+)$", text, flags=re.M)
    logged = {int(per_case[i]): per_case[i + 1] for i in range(1, len(per_case), 2)}
    rows = []
    for i, (name, plan) in enumerate(plans.items()):
        fig = plan["vllm_cpu"]
        got = vllm_peer.parse_kv_line(logged.get(i, ""))
        rows.append(f"{name}: plan {fig['kv_cache_tokens']:,} / {fig['max_concurrency']:.2f}x, "
                    f"vLLM {got and got['line']}")
        _check(plan, got)
        done = re.search(rf"^@@done {i} (\d+) ([\d.]+)$", logged[i], flags=re.M)
        assert done and int(done[1]) == fig["kv_cache_tokens"] and float(done[2]) == fig["max_concurrency"]
    print("\n".join(rows))
    per_token = {n: p["vllm_cpu"]["bytes_per_token"] for n, p in plans.items()}
    assert any(b & (b - 1) for b in per_token.values())  # some KV per token is not a power of two
