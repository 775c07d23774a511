"""Runs async jobs when capacity allows.

Workers take job ids from an in-memory queue that is rebuilt from disk at start, so
the disk is the source of truth. A job acquires a slot as a background request: it
waits as long as it must (no queue deadline) but in the lowest-priority class order,
so async work never takes a slot from a waiting interactive request. An unreachable
upstream puts the job back in the queue with a growing pause instead of failing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from tierguard.gate.admission import AdmissionController, AdmissionDecision, RequestInfo
from tierguard.gate.forward import UpstreamError
from tierguard.gate.jobs import Job, JobStore
from tierguard.gate.reqlog import RequestLog, RequestRecord

log = logging.getLogger("tierguard.gate")


class JsonPoster(Protocol):
    """Where jobs go: `upstreams.Fleet` (routed, with one failover) or one `forward.Upstream`."""

    async def post_json(self, path: str, body: dict) -> tuple[int, dict]: ...

MAX_ATTEMPTS = 5


class JobRunner:
    def __init__(self, store: JobStore, controller: AdmissionController, upstream: JsonPoster,
                 reqlog: RequestLog, workers: int) -> None:
        self.store = store
        self.controller = controller
        self.upstream = upstream
        self.reqlog = reqlog
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self.n_workers = workers
        self._tasks: list[asyncio.Task] = []

    def start(self) -> int:
        """Start workers and re-queue every pending job on disk; returns how many."""
        pending = self.store.pending()
        for job in pending:
            self.queue.put_nowait(job.id)
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.n_workers)]
        return len(pending)

    def submit(self, job: Job) -> None:
        self.queue.put_nowait(job.id)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _worker(self) -> None:
        while True:
            job_id = await self.queue.get()
            job = self.store.load(job_id)
            if job is None or job.status not in ("queued", "running"):
                continue
            try:
                await self._run(job)
            except asyncio.CancelledError:
                raise  # shutdown: the job stays queued/running on disk and reruns at next start
            except Exception as exc:  # a bug must not kill the worker; the job records it
                log.exception("async job %s failed", job.id)
                self._finish(job, "failed", 500, None, f"internal error: {type(exc).__name__}")

    async def _run(self, job: Job) -> None:
        info = RequestInfo(input_tokens=job.input_tokens,
                           priority="batch", background=True)
        try:
            ticket = await self.controller.acquire(info)
        except AdmissionDecision as d:
            self._finish(job, "failed", getattr(d, "status", 429), None, d.message)
            return
        job.status, job.attempts = "running", job.attempts + 1
        self.store.save(job)
        try:
            try:
                status, data = await self.upstream.post_json(job.route, job.body)
            finally:  # the slot goes back as the call ends: before any back-off, and on a bug too
                self.controller.release(ticket)
        except UpstreamError as exc:
            if exc.kind == "unreachable" and job.attempts < MAX_ATTEMPTS:
                job.status = "queued"
                self.store.save(job)
                await asyncio.sleep(min(30.0, 0.5 * 2**job.attempts))
                self.queue.put_nowait(job.id)
                return
            self._finish(job, "failed", exc.status, None, exc.message)
            return
        self._finish(job, "succeeded" if status == 200 else "failed", status, data,
                     None if status == 200 else "upstream answered with an error")
        usage = data.get("usage") or {}
        self.reqlog.write(RequestRecord(route=job.route, model=job.body.get("model"), klass=ticket.klass,
                                        input_tokens=info.input_tokens,
                                        output_tokens=usage.get("completion_tokens"),
                                        queue_wait_ms=round(ticket.queue_wait_s * 1000, 3), decision="async",
                                        reason="job_run", status=status, job_id=job.id))

    def _finish(self, job: Job, status: str, http_status: int, result: dict | None, error: str | None) -> None:
        job.status, job.http_status, job.result, job.error = status, http_status, result, error
        self.store.save(job)
