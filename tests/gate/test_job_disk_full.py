"""A full disk under the jobs directory: a new job gets 507 (counted), jobs whose state cannot
be written fail with the reason, and the workers live on to run the next job.

The disk is a real 1 MiB tmpfs when the tests run as root (job_env.TinyDisk)."""

from __future__ import annotations

import asyncio

import pytest

from tests.gate.helpers import metric
from tests.gate.job_env import HeldUpstream, TinyDisk, gate_in_process, job, live_workers, post, until_done

ASYNC = "/v1/async/completions"


@pytest.fixture
def disk(tmp_path, monkeypatch):
    d = TinyDisk(tmp_path, monkeypatch)
    yield d
    d.close()


def test_a_full_disk_answers_507_and_is_counted(disk):
    async def go():
        up = await HeldUpstream().start()
        try:
            async with gate_in_process(up.url, disk.dir / "jobs") as (_app, gate, s):
                disk.fill()
                full = await post(s, gate + ASYNC, {"prompt": "p" * 2000})
                counted = await metric(s, gate, "tierguard_gate_jobs_disk_full_total")
                answered = await metric(s, gate, "tierguard_gate_responses_total", status="507")
                disk.free()
                room = await post(s, gate + ASYNC, {"prompt": "p" * 2000})
                return full, counted, answered, room
        finally:
            await up.stop()

    (status, body, _), counted, answered, room = asyncio.run(go())
    assert status == 507, body
    assert body["error"]["type"] == "insufficient_storage" and "full" in body["error"]["message"]
    assert counted >= 1 and answered == 1
    assert room[0] == 202  # space again: jobs are taken again (the failed write left nothing behind)
    assert not [p for p in (disk.dir / "jobs").iterdir() if p.name.endswith(".tmp")]


def test_workers_survive_jobs_that_fail_and_the_next_job_completes(disk):
    """Four workers, each running a job while four more wait in the queue; the disk fills.
    The running four cannot store their results, the waiting four cannot store their
    "running" state: each of the eight fails with a reason a client can read, all four
    workers live on, and once the disk has room a ninth job runs to the end."""

    async def go():
        up = await HeldUpstream().start()
        try:
            async with gate_in_process(up.url, disk.dir / "jobs", async_workers=4) as (app, gate, s):
                ids = [(await post(s, gate + ASYNC, {"prompt": f"job {i} " * 50}))[1]["id"] for i in range(8)]
                await up.until_arrived(4)  # four running (their state on disk), four queued
                disk.fill()
                up.release()
                failed = [await until_done(s, gate, i, app=app) for i in ids]
                counted = await metric(s, gate, "tierguard_gate_jobs_failed_internal_total")
                disk.free()
                status, body, _ = await post(s, gate + ASYNC, {"prompt": "the ninth"})
                last = await until_done(s, gate, body["id"], app=app)
                return failed, counted, status, last, live_workers(app), up.arrived
        finally:
            await up.stop()

    failed, counted, status, last, workers, arrived = asyncio.run(go())
    for j in failed:
        assert j["status"] == "failed" and j["http_status"] == 507, j
        assert "full" in j["error"], j
    assert counted == 4  # the four whose "running" write raised inside the worker
    assert arrived == 5  # the queued four never reached the upstream; the ninth did
    assert status == 202 and last["status"] == "succeeded", last
    assert workers == 4


def test_a_job_whose_running_state_cannot_be_written_fails_and_frees_its_slot(disk):
    """One worker: the second job waits in the queue while the first runs, the disk fills,
    so the second job's "running" write fails. It fails with the reason (kept in memory:
    the disk cannot hold it) and the admission slot it took comes back."""

    async def go():
        up = await HeldUpstream().start()
        try:
            async with gate_in_process(up.url, disk.dir / "jobs", async_workers=1) as (app, gate, s):
                from tierguard.gate.state import GATE

                first = (await post(s, gate + ASYNC, {"prompt": "first"}))[1]["id"]
                await up.until_arrived(1)
                second = (await post(s, gate + ASYNC, {"prompt": "second"}))[1]["id"]
                disk.fill()
                up.release()
                done = [await until_done(s, gate, i, app=app) for i in (first, second)]
                stats = app[GATE].controller.stats()
                return done, stats, up.arrived, await job(s, gate, second)
        finally:
            await up.stop()

    done, stats, arrived, again = asyncio.run(go())
    for j in done:
        assert j["status"] == "failed" and j["http_status"] == 507, j
    assert arrived == 1  # the second job never reached the upstream: its state could not be kept
    assert sum(stats.in_flight.values()) == 0
    assert again == done[1]
