"""End to end: the real `tierguard sweep` CLI drives the real `tierguard bench` against real
schedule servers whose capacities are known, so their boundaries are known."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from sweep.helpers import failing_variant, schedule_variant

pytestmark = pytest.mark.slow


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tierguard", *args], capture_output=True, text=True, timeout=timeout
    )


def test_sweep_and_report_with_real_bench(tmp_path):
    # Service time of one request: 30 + 7 x 10 = 100 ms; a request that waits for a slot
    # has TTFT >= 130 ms, so the 120 ms TTFT SLO holds exactly up to each capacity. Delays on
    # a loaded machine only lengthen latencies: the SLOs leave them 90 ms (TTFT) and 70 ms
    # (gap) below capacity, and nothing can bring a waiting request under 130 ms.
    matrix = {
        "name": "e2e",
        "variants": [
            schedule_variant("cap4", 4, ttft_ms=30, itl_ms=10),
            failing_variant(),
            schedule_variant("cap2", 2, ttft_ms=30, itl_ms=10),
        ],
        "profile": {"context_lengths": [32], "output_len": 8, "num_requests": 8, "min_rounds": 2},
        "slices": {
            "ladder": [1, 2, 4, 8],
            "mixed": {"short_len": 16, "long_len": 64, "long_share": 0.25, "concurrency": [2]},
        },
        "slo": {"p99_ttft_ms": 120, "p99_itl_ms": 80},
        "uncertainty": {"bootstrap": 100},
    }
    mpath = tmp_path / "m.yaml"
    mpath.write_text(yaml.safe_dump(matrix))
    run_dir = tmp_path / "run"
    res = cli("sweep", str(mpath), "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((run_dir / "boundary.json").read_text())
    assert doc["variants"]["cap4"]["contexts"]["32"]["max_concurrency"] == 4
    assert doc["variants"]["cap2"]["contexts"]["32"]["max_concurrency"] == 2
    assert doc["variants"]["broken"]["status"] == "failed"
    # the real bench wrote its files, with one fingerprint per cell shared by both variants
    state = json.loads((run_dir / "state.json").read_text())
    fp4 = state["cells"]["cap4"]["ladder-ctx32-c2"]["fingerprint"]
    assert fp4 and fp4 == state["cells"]["cap2"]["ladder-ctx32-c2"]["fingerprint"]
    assert (run_dir / "cap4" / "ladder-ctx32-c4" / "r0" / "requests.jsonl").exists()
    mixed = state["cells"]["cap2"]["mixed-ctx64-c2"]
    assert mixed["completed"] >= 8 and mixed["passed"]
    lengths = {
        json.loads(line)["input_len"]
        for line in (run_dir / "cap2" / "mixed-ctx64-c2" / "r0" / "requests.jsonl").read_text().splitlines()
    }
    assert lengths <= {16, 64}
    report = run_dir / "report" / "report.html"
    assert report.exists() and "cap4" in report.read_text()
    assert "cap4" in res.stdout and "boundary" in res.stdout.lower()

    # resuming a finished sweep runs nothing and starts no engine
    again = cli("sweep", str(mpath), "--run-dir", str(run_dir), "--no-report")
    assert again.returncode == 0
    assert "already done" in again.stdout
    assert json.loads((run_dir / "boundary.json").read_text()) == doc

    out = tmp_path / "rep"
    rep = cli("report", str(run_dir), "--output-dir", str(out))
    assert rep.returncode == 0 and (out / "report.md").exists()
