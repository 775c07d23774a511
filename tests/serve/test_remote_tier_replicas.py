"""Two real `tierguard serve` processes on one real Redis (bench/remote_tier.py, small):
a prefix prefilled on A is staged from Redis on B (remote hits counted on B), then Redis
is killed with SIGKILL mid-run and no request fails, /health says degraded and every
request after the kill is a counted recompute decision."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tierguard.common.redis_server import INSTALL_HINT, redis_server_path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "remote_tier.py"


@pytest.mark.slow
def test_two_replicas_share_a_prefix_and_survive_redis_kill(capsys):
    if redis_server_path() is None:
        pytest.skip(INSTALL_HINT)
    spec = importlib.util.spec_from_file_location("remote_tier_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--prefix-tokens", "512", "--prefixes", "1", "--kill-requests", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["valid"], out["invalid_reasons"]
    assert out["b_measured"]["kv_remote_hits"] >= 512 // 16
    assert out["kill"]["health_after_kill"] == "degraded" and out["errors"] == []
    assert out["kill"]["counter_deltas"]["kv_contract_interactive_recompute"] >= 2
