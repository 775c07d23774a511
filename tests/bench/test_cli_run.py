"""End to end through the CLI: output files, fingerprints, workers, Ctrl-C, metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tierguard.bench.results import load_run
from tierguard.bench.schedule_server import ScheduleServer
from tierguard.cli.main import main


@pytest.fixture(scope="module")
def server():
    with ScheduleServer(ttft_ms=10, itl_ms=4) as s:
        yield s


def _run(server, out, *extra) -> int:
    return main(["bench", "--base-url", server.base_url, "--input-len", "8", "--output-len", "8",
                 "--num-requests", "6", "--request-rate", "50", "--no-progress", "--output-dir", str(out), *extra])


VLLM_KEYS = ["completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput"] + [
    f"{s}_{m}" for s in ("mean", "median", "std", "p90", "p95", "p99", "p999") for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
]
OUR_KEYS = ["rejected", "goodput", "mean_stall_ms", "p99_stall_ms", "max_stall_ms", "mean_queue_wait_ms",
            "p99_queue_wait_ms", "p99_chunk_gap_ms", "client_distorted"]


def test_output_dir_files_and_keys(server, tmp_path):
    assert _run(server, tmp_path / "a", "--slo", "ttft=1000,itl=500", "--warmup", "1") == 0
    run = load_run(tmp_path / "a")
    for k in VLLM_KEYS + OUR_KEYS:
        assert k in run.summary, k
    assert run.summary["completed"] == 5 and run.summary["warmup_excluded"] == 1
    assert run.summary["goodput"] > 0
    assert len(run.records) == 6 and {r.phase for r in run.records} == {"warmup", "measure"}
    rec = run.records[-1]
    assert rec.chunk_times_s and rec.chunk_tokens and rec.output_tokens == 8 and rec.status == "ok"
    env = run.run["environment"]
    for k in ("tierguard", "python", "platform", "cpu", "ram_bytes", "engine", "topology"):
        assert k in env
    assert env["engine"]["version"] == "schedule-server-1"
    assert run.run["config"]["request_rate"] == 50
    assert run.timeseries and "in_flight" in run.timeseries[0]
    assert run.summary["server_metrics"]["scrapes"] >= 1  # the schedule server has /metrics
    assert (tmp_path / "a" / "metrics.jsonl").is_file()


def test_fingerprint_identical_iff_profile_identical(server, tmp_path):
    for name, extra in (("a", []), ("b", ["--workers", "2"]), ("c", ["--seed", "1"]), ("e", ["--max-concurrency", "2"])):
        assert _run(server, tmp_path / name, *extra) == 0
    fp = {n: load_run(tmp_path / n).fingerprint for n in "abce"}
    assert fp["a"] == fp["b"]  # worker count and output dir do not change the profile
    assert len({fp["a"], fp["c"], fp["e"]}) == 3
    b = load_run(tmp_path / "b")
    assert b.summary["workers"] == 2 and {r.worker for r in b.records} == {0, 1}
    assert sorted(r.index for r in b.records) == list(range(6))


def test_ctrl_c_writes_partial_results(server, tmp_path):
    out = tmp_path / "int"
    p = subprocess.Popen([sys.executable, "-m", "tierguard", "bench", "--base-url", server.base_url, "--input-len", "4",
                          "--output-len", "2000", "--num-requests", "4", "--output-dir", str(out), "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until the run is under way (tokens flowing)
            time.sleep(0.3)
            if server_active(server) >= 4:
                break
        os.kill(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err
    run = load_run(out)
    assert run.summary["interrupted"] is True
    assert {r.status for r in run.records} == {"cancelled"}


def server_active(server) -> int:
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/health", timeout=5) as r:
        return json.loads(r.read())["active"]
