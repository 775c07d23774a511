"""Async jobs are bounded: pending jobs and bytes per API key and in total; their files are
written off the event loop, completely or not at all."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from tests.gate.job_env import HeldUpstream, gate_in_process, post, until_done
from tierguard.gate.jobs import JobStore
from tierguard.gate.policy import GateSettings

ASYNC = "/v1/async/completions"


def test_pending_quota_per_key_and_in_total(tmp_path):
    async def go():
        up = await HeldUpstream().start()  # holds every job: they stay pending
        try:
            async with gate_in_process(up.url, tmp_path / "jobs", api_keys=["sk-a", "sk-b"], async_workers=1,
                                       async_max_pending=3, async_max_pending_per_key=2) as (_app, gate, s):
                url = gate + ASYNC
                a = [await post(s, url, {"prompt": f"a{i}"}, "sk-a") for i in range(3)]
                b = [await post(s, url, {"prompt": f"b{i}"}, "sk-b") for i in range(2)]
                async with s.get(gate + "/metrics") as r:
                    metrics = await r.text()
                up.release()
                for (status, body, _), key in ((a[0], "sk-a"), (a[1], "sk-a"), (b[0], "sk-b")):
                    assert status == 202
                    assert (await until_done(s, gate, body["id"], key))["status"] == "succeeded"
                # the quota counts pending jobs: once they finished, there is room again
                assert (await post(s, url, {"prompt": "a-again"}, "sk-a"))[0] == 202
                return a, b, metrics
        finally:
            await up.stop()

    a, b, metrics = asyncio.run(go())
    assert [x[0] for x in a] == [202, 202, 429]
    status, body, headers = a[2]
    assert "--async-max-pending-per-key 2" in body["error"]["message"]
    assert body["error"]["type"] == "rate_limit_exceeded" and int(headers["Retry-After"]) > 0
    # the other key is not refused by the first one's quota; then the total binds
    assert [x[0] for x in b] == [202, 503]
    status, body, headers = b[1]
    assert "--async-max-pending 3" in body["error"]["message"] and int(headers["Retry-After"]) > 0
    assert 'tierguard_gate_jobs_refused_total{reason="quota_key_pending"} 1.0' in metrics
    assert 'tierguard_gate_jobs_refused_total{reason="queue_full"} 1.0' in metrics
    assert "tierguard_gate_jobs_pending 3.0" in metrics


def test_byte_quota_per_key_and_in_total(tmp_path):
    prompt = "x" * 3000  # each job file is a little over 3000 bytes

    async def go():
        up = await HeldUpstream().start()
        try:
            async with gate_in_process(up.url, tmp_path / "jobs", api_keys=["sk-a", "sk-b"],
                                       async_max_bytes_per_key=7000, async_max_bytes=10_000) as (_app, gate, s):
                url = gate + ASYNC
                a = [await post(s, url, {"prompt": prompt}, "sk-a") for _ in range(3)]
                b = [await post(s, url, {"prompt": prompt}, "sk-b") for _ in range(2)]
                huge = await post(s, url, {"prompt": "y" * 8000}, "sk-b")
                return a, b, huge
        finally:
            await up.stop()

    a, b, huge = asyncio.run(go())
    assert [x[0] for x in a] == [202, 202, 429]
    assert "--async-max-bytes-per-key 7000" in a[2][1]["error"]["message"] and "Retry-After" in a[2][2]
    assert [x[0] for x in b] == [202, 503]
    assert "--async-max-bytes 10000" in b[1][1]["error"]["message"]
    # one job bigger than a key may ever hold: retrying cannot help, so no Retry-After
    assert huge[0] == 413 and "--async-max-bytes-per-key" in huge[1]["error"]["message"]
    assert "Retry-After" not in huge[2]
    files = [p for p in (tmp_path / "jobs").iterdir()]
    assert len(files) == 3 and sum(p.stat().st_size for p in files) <= 10_000


def test_quotas_count_the_jobs_already_on_disk_at_start(tmp_path):
    from tierguard.gate.job_quota import JobLimits, JobRefused
    from tierguard.gate.jobs import owner_id

    limits = JobLimits(max_pending=10, max_pending_per_key=2)
    first = JobStore(tmp_path / "jobs", limits=limits)
    for _ in range(2):
        first.create("/v1/completions", {"prompt": "p"}, 1, owner=owner_id("sk-a"))
    again = JobStore(tmp_path / "jobs", limits=limits)  # a restart: the ledger is rebuilt from the files
    with pytest.raises(JobRefused) as refused:
        again.create("/v1/completions", {"prompt": "p"}, 1, owner=owner_id("sk-a"))
    assert refused.value.status == 429 and again.refused == {"quota_key_pending": 1}
    assert again.create("/v1/completions", {"prompt": "p"}, 1, owner=owner_id("sk-b")).status == "queued"


def test_quota_flags_are_validated_and_named():
    from tierguard.common.errors import TierguardError

    for name in ("async_max_pending", "async_max_pending_per_key", "async_max_bytes", "async_max_bytes_per_key"):
        with pytest.raises(TierguardError, match=name):
            GateSettings(upstream="http://127.0.0.1:9", **{name: 0}).validate()


def test_a_short_write_is_continued_until_the_whole_file_is_out(tmp_path, monkeypatch):
    """os.write may write less than it was given; a job file cut short would be lost."""
    import tierguard.gate.jobs as jobs

    real_write = os.write
    calls = []

    def short_write(fd: int, data) -> int:
        calls.append(len(data))
        return real_write(fd, bytes(data[:7]))  # at most 7 bytes per call

    monkeypatch.setattr(jobs.os, "write", short_write)
    store = JobStore(tmp_path / "jobs")
    made = store.create("/v1/completions", {"prompt": "a prompt longer than seven bytes"}, 3)
    monkeypatch.setattr(jobs.os, "write", real_write)
    assert len(calls) > 1
    assert JobStore(tmp_path / "jobs").load(made.id).body == {"prompt": "a prompt longer than seven bytes"}


def test_job_files_are_written_off_the_event_loop_which_stays_responsive(tmp_path, monkeypatch):
    """While a job's file is being written (its fsync held here until /health has answered),
    the gate answers other requests: file I/O runs in a worker thread, never on the loop."""
    import tierguard.gate.jobs as jobs

    real_fsync = os.fsync
    syncers: list[threading.Thread] = []
    health_answered = threading.Event()

    def watched_fsync(fd: int) -> None:
        syncers.append(threading.current_thread())
        if threading.current_thread() is not threading.main_thread():  # on the loop: never block it
            health_answered.wait(60)
        real_fsync(fd)

    monkeypatch.setattr(jobs.os, "fsync", watched_fsync)

    async def go():
        up = await HeldUpstream().start()
        up.release()
        try:
            async with gate_in_process(up.url, tmp_path / "jobs") as (_app, gate, s):
                syncers.clear()  # start-up's own writes do not count
                submit = asyncio.create_task(post(s, gate + ASYNC, {"prompt": "z" * 1_000_000}))
                while not syncers:
                    await asyncio.sleep(0.01)
                async with s.get(gate + "/health") as r:
                    health = r.status
                health_answered.set()
                status, body, _ = await submit
                done = await until_done(s, gate, body["id"])
                return health, status, done
        finally:
            health_answered.set()
            await up.stop()

    health, status, done = asyncio.run(go())
    assert health == 200 and status == 202 and done["status"] == "succeeded"
    assert syncers and all(t is not threading.main_thread() for t in syncers), syncers


def test_quota_defaults_are_the_documented_ones():
    import re

    from tierguard.cli.gate import _GATE_FLAGS
    from tierguard.common.units import parse_bytes
    from tierguard.gate.job_quota import JobLimits

    settings = GateSettings(upstream="http://127.0.0.1:9").validate()
    assert settings.job_limits() == JobLimits()
    for flag in ("async-max-pending", "async-max-pending-per-key", "async-max-bytes", "async-max-bytes-per-key"):
        documented = re.search(r"\(default ([^;)]+)", _GATE_FLAGS[flag][1]).group(1)
        assert getattr(settings, flag.replace("-", "_")) == parse_bytes(documented, flag), flag
