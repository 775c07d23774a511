"""Bad servers and bad flags: one clear message, no traceback, partial results written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from aiohttp import web

from tierguard.bench.config import BenchConfig
from tierguard.bench.runner import run_bench
from tierguard.bench.schedule_server import ScheduleServer
from tierguard.cli.main import main
from tierguard.common.errors import TierguardError


def cfg(url: str, tmp_path, **kw) -> BenchConfig:
    base = dict(base_url=url, model="m", input_len=4, output_len=4, num_requests=4, show_progress=False,
                output_dir=str(tmp_path / "out"), timeout=10)
    return BenchConfig(**{**base, **kw})


def test_unreachable_server_is_one_message_and_writes_partial_results(tmp_path, free_port):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TierguardError, match="cannot reach server"):
        run_bench(cfg(url, tmp_path))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "cannot reach server" in summary["error"]
    assert json.loads((tmp_path / "out" / "run.json").read_text())["config"]["base_url"] == url


def test_wrong_endpoint_says_404(tmp_path):
    with ScheduleServer() as s, pytest.raises(TierguardError, match="404"):
        run_bench(cfg(s.base_url + "/nope", tmp_path))


def test_server_error_on_probe(tmp_path, serve_app):
    async def boom(_):
        return web.json_response({"error": {"message": "engine exploded"}}, status=500)

    app = web.Application()
    app.router.add_post("/v1/completions", boom)
    with serve_app(app) as url, pytest.raises(TierguardError, match="engine exploded"):
        run_bench(cfg(url, tmp_path))
    assert (tmp_path / "out" / "summary.json").is_file()


def test_non_sse_body(tmp_path, serve_app):
    async def plain(_):
        return web.json_response({"choices": [{"text": "hello"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", plain)
    with serve_app(app) as url, pytest.raises(TierguardError, match="not an SSE stream"):
        run_bench(cfg(url, tmp_path))


def _flaky_app() -> web.Application:
    """Every third request fails: 429, 500 or an error event in the middle of the stream."""
    count = {"n": 0}

    async def handler(request):
        count["n"] += 1
        n = count["n"]
        if n > 1 and n % 3 == 0:
            return web.json_response({"error": {"message": "slow down"}}, status=429)
        if n > 1 and n % 3 == 1 and n % 2 == 0:
            return web.json_response({"error": {"message": "internal"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(4):
            await resp.write(f'data: {{"choices":[{{"text":" t{i}"}}],"usage":{{"completion_tokens":{i + 1}}}}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    return app


def test_failures_are_counted_and_miss_the_slo(tmp_path, serve_app):
    from tierguard.bench.config import parse_slo

    with serve_app(_flaky_app()) as url:
        res = run_bench(cfg(url, tmp_path, num_requests=12, slo=parse_slo("ttft=10000")))
    s = res.summary
    assert s["completed"] + s["failed"] == 12
    assert s["rejected"] >= 3 and s["failed"] > s["rejected"]
    assert s["slo_attainment"] == pytest.approx(s["completed"] / 12)
    assert any("429" in e for e in s["errors"])
    lines = (tmp_path / "out" / "requests.jsonl").read_text().splitlines()
    statuses = {json.loads(line)["status"] for line in lines}
    assert {"ok", "rejected", "failed"} <= statuses


def test_strict_server_rejecting_unknown_fields_is_retried_and_reported(tmp_path):
    with ScheduleServer(ttft_ms=5, itl_ms=2, reject_unknown_fields=True) as s:
        res = run_bench(cfg(s.base_url, tmp_path, num_requests=3))
    assert res.summary["completed"] == 3
    assert "ignore_eos" in res.summary["quirks"]["dropped_fields"]


@pytest.mark.parametrize("argv, needle", [
    (["--request-rate", "fast"], "invalid rate"),
    (["--slo", "latency=5"], "--slo"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--input-len", "-3"], "input-len"),
    (["--dataset", "trace"], "--trace"),
    (["--base-url", "localhost:8000"], "--base-url"),
    (["--warmup", "abc"], "--warmup"),
])
def test_invalid_flags_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        code = main(["bench", *argv])
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err  # one line: no 20-line usage block around it


def test_cli_unreachable_exit_2_no_traceback(tmp_path, free_port):
    url = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run([sys.executable, "-m", "tierguard", "bench", "--base-url", url, "--model", "m",
                        "--output-dir", str(tmp_path / "o"), "--num-requests", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "cannot reach server" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "o" / "summary.json").is_file()
