"""Every vLLM flag `tierguard plan` emits, at each vLLM version whose rules it mirrors, is
accepted by the real vLLM's server argument parser (parsed only; no server starts).

The plan cases below are chosen so that together they reach every branch of
`plan/flags.py:vllm_flags` (TP, PP, block size, fp8 KV of each kind, prefix caching, KV
offload, weight offload) and the CPU plan's own flags; a flag the parser refuses fails
the test with its name and vLLM's message.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.vllm.conftest import ROOT
from tierguard.plan.inputs import PlanInputs
from tierguard.plan.planner import make_plan
from tierguard.plan.reserves import BANDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # vLLM start-ups take minutes on a busy machine

GPU_CASES = [
    dict(model="Qwen/Qwen3-8B", gpu="L4", contexts=[32768], concurrency=4, offload="both", kv_offload_gib=64,
         weights_offload_gib=16, host_ram_gib=256),
    dict(model="Qwen/Qwen3-8B", gpu="H100-80GB", tp=2, pp=2, block_size=32, prefix_caching=True, contexts=[8192]),
    dict(model="meta-llama/Llama-3.1-70B", gpu="L40S", tp=2, contexts=[8192], concurrency=2, offload="weights",
         weights_offload_gib=64, host_ram_gib=512, allow_kv_quant=False),
    dict(model="deepseek-ai/DeepSeek-V3", gpu="H200-141GB", tp=8, contexts=[32768], kv_dtype="fp8_ds_mla"),
    dict(model="Qwen/Qwen3-32B", gpu="H100-80GB", contexts=[32768], kv_dtype="fp8_e5m2", shared_prefix=4096,
         concurrency=8),
]
EVERY_FLAG = {
    "--tensor-parallel-size", "--pipeline-parallel-size", "--max-model-len", "--max-num-seqs",
    "--gpu-memory-utilization", "--max-num-batched-tokens", "--block-size", "--kv-cache-dtype",
    "--enable-prefix-caching", "--kv-offloading-size", "--kv-offloading-backend", "--cpu-offload-gb",
}


def _versions() -> list[str | None]:
    return [".".join(map(str, b.first)) for b in BANDS] + [None]  # each band's first version, and newest


def test_every_flag_plan_emits_is_accepted_by_vllm(vllm_venv, tmp_path):
    lists, seen = [], set()
    for version in _versions():
        for case in GPU_CASES:
            flags = make_plan(PlanInputs(engine="vllm", engine_version=version, **case))["flags"]["vllm"]
            lists.append(flags)
            seen |= {f for f in flags if f.startswith("--")}
    assert seen == EVERY_FLAG, f"the cases miss {EVERY_FLAG - seen}"  # every branch reached
    kv_dtypes = {f[i + 1] for f in lists for i, x in enumerate(f) if x == "--kv-cache-dtype"}
    assert kv_dtypes == {"fp8", "fp8_e5m2", "fp8_ds_mla"}
    (tmp_path / "flags.json").write_text(json.dumps(lists))
    out = subprocess.run([str(vllm_venv), str(ROOT / "tests" / "vllm" / "parse_flags.py"), str(tmp_path / "flags.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    refused = {r["flag"]: r["why"] for res in results for r in res["refused"]}
    assert not refused, f"vLLM 0.32 refuses: {refused}"
    assert all(r["ok"] for r in results) and len(results) == len(lists)


def test_the_parser_check_names_a_flag_vllm_does_not_know(vllm_venv, tmp_path):
    (tmp_path / "flags.json").write_text(json.dumps([["--max-model-len", "4096", "--swap-space", "4",
                                                      "--kv-cache-dtype", "int3"]]))
    out = subprocess.run([str(vllm_venv), str(ROOT / "tests" / "vllm" / "parse_flags.py"), str(tmp_path / "flags.json")],
                         capture_output=True, text=True, timeout=600)
    res = json.loads(out.stdout.strip().splitlines()[-1])[0]
    assert not res["ok"] and [r["flag"] for r in res["refused"]] == ["--swap-space", "--kv-cache-dtype"]
