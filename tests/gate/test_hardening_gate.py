"""The gate against slow and greedy peers, and its async jobs as protected data.

Real processes and real sockets: a gate subprocess in front of the schedule server.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import aiohttp

from tests.gate.helpers import GateProcess, get_json, run
from tierguard.bench.schedule_server import ScheduleServer

KEY_A, KEY_B = "sk-tenant-a-123", "sk-tenant-b-456"
SECRET = "confidential-prompt-text"


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def _metrics(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(url + "/metrics") as r:
        return await r.text()


def test_jobs_belong_to_their_key_are_encrypted_and_expire(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    os.chmod(keys, 0o600)  # a key file others can read is refused, like the encryption key
    enc = tmp_path / "enc.key"
    enc.write_bytes(os.urandom(32))
    os.chmod(enc, 0o600)
    jobs = tmp_path / "jobs"
    with ScheduleServer(ttft_ms=20, itl_ms=5, output_tokens=5) as up, \
            GateProcess(up.base_url, "--api-key-file", str(keys), "--encrypt-key-file", str(enc),
                        "--job-ttl-s", "2", jobs_dir=jobs) as gate:

        async def main():
            a, b = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": SECRET, "max_tokens": 5}
                async with s.post(gate.url + "/v1/async/completions", json=body, headers=a) as r:
                    assert r.status == 202
                    job_id = (await r.json())["id"]
                deadline = time.monotonic() + 10
                while True:
                    async with s.get(f"{gate.url}/v1/async/{job_id}", headers=a) as r:
                        mine = await r.json()
                    if mine["status"] == "succeeded" or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
                files = [(f.suffix, f.read_bytes()) for f in jobs.iterdir()]
                async with s.get(f"{gate.url}/v1/async/{job_id}", headers=b) as r:
                    other = (r.status, await r.json())
                async with s.get(f"{gate.url}/v1/async/job-{'0' * 32}", headers=a) as r:
                    unknown = (r.status, await r.json())
                await asyncio.sleep(2.8)  # ttl 2 s; the sweeper runs every ttl/4
                async with s.get(f"{gate.url}/v1/async/{job_id}", headers=a) as r:
                    expired = r.status
                return mine, files, other, unknown, expired, jobs.iterdir(), await _metrics(s, gate.url)

        mine, files, other, unknown, expired, left, metrics = run(main())
    assert mine["status"] == "succeeded" and mine["result"]["choices"]
    # another tenant gets exactly what an unknown id gets: nothing says the job exists
    assert other == unknown and other[0] == 404
    assert [suffix for suffix, _ in files] == [".job"]
    assert files[0][1].startswith(b"TGE1") and SECRET.encode() not in files[0][1]
    assert expired == 404 and not list(left)
    assert _metric(metrics, "tierguard_gate_jobs_expired_total") == 1


def test_slow_headers_slow_readers_and_the_byte_rule(tmp_path):
    from tierguard.model.tiny import ensure_tiny_model

    with ScheduleServer(ttft_ms=10, itl_ms=1, tokens_per_chunk=4) as up, \
            GateProcess(up.base_url, "--header-timeout-s", "1", "--slow-reader-bytes", "16KiB",
                        "--tokenizer", str(ensure_tiny_model()), "--max-model-len", "64",
                        jobs_dir=tmp_path / "jobs") as gate:
        port = gate.port

        async def main():
            # 40 connections that never finish their headers
            slow = []
            for _ in range(40):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
                slow.append((r, w))
            t0 = time.monotonic()
            async with aiohttp.ClientSession() as s:
                # meanwhile a normal request is served
                async with s.post(gate.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                                  timeout=aiohttp.ClientTimeout(total=10)) as r:
                    assert r.status == 200, await r.text()
                answers = await asyncio.gather(*(asyncio.wait_for(r.read(), 5) for r, _ in slow))
                closed_after = time.monotonic() - t0
                # a client that stops reading a long stream: ended, its slot freed
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", port))
                req = json.dumps({"prompt": "go", "stream": True, "max_tokens": 20000}).encode()
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(req) + req)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    m = await _metrics(s, gate.url)
                    if _metric(m, "tierguard_gate_http_slow_readers_total") >= 1:
                        break
                    await asyncio.sleep(0.1)
                sock.close()
                _, health = await get_json(s, gate.url + "/health")
                # the byte rule: 64 tokens x 17 bytes cannot fit, refused without a count
                async with s.post(gate.url + "/v1/completions", json={"prompt": "x" * (64 * 17)}) as r:
                    refused = (r.status, (await r.json())["error"]["message"])
                # the body limit follows from max_model_len: 64 * (6 * 17 + 64) + 64 KiB
                async with s.post(gate.url + "/v1/completions", json={"prompt": "y" * 90_000}) as r:
                    too_large = r.status
                return answers, closed_after, m, health, refused, too_large, await _metrics(s, gate.url)

        answers, closed_after, m, health, refused, too_large, final = run(main())
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers) and 0.9 < closed_after < 4
    assert _metric(final, "tierguard_gate_http_header_timeouts_total") == 40
    assert _metric(m, "tierguard_gate_http_slow_readers_total") == 1
    assert sum(health["in_flight"].values()) == 0
    assert refused[0] == 400 and "refused before tokenizing" in refused[1]
    assert _metric(final, "tierguard_gate_byte_rule_refusals_total") == 1
    assert too_large == 413 and _metric(final, "tierguard_gate_http_body_too_large_total") == 1


def test_bad_hardening_options_are_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    loose = tmp_path / "loose.key"
    loose.write_bytes(os.urandom(32))
    os.chmod(loose, 0o644)
    cases = [
        (["gate", "--upstream", "http://127.0.0.1:9", "--encrypt-key-file", str(loose)], "chmod 600"),
        (["gate", "--upstream", "http://127.0.0.1:9", "--encrypt-old-key-file", str(loose)], "needs --encrypt-key-file"),
        (["gate", "--upstream", "http://127.0.0.1:9", "--job-ttl-s", "0"], "job_ttl_s must be a positive"),
        (["serve", "--slow-reader-bytes", "10"], "slow_reader_bytes must be"),
        (["serve", "--header-timeout-s", "0"], "header_timeout_s must be"),
    ]
    for argv, expected in cases:
        p = subprocess.run([sys.executable, "-m", "tierguard", *argv, "--port", "0"], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "HOME": str(tmp_path)})
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1 and expected in lines[0], (argv, p.stderr)
        assert "Traceback" not in p.stderr
