"""Runs async jobs when capacity allows.

Workers take job ids from an in-memory queue that is rebuilt from disk at start, so
the disk is the source of truth. A job acquires a slot as a background request: it
waits as long as it must (no queue deadline) but in the lowest-priority class order,
so async work never takes a slot from a waiting interactive request. An unreachable
upstream puts the job back in the queue with a growing pause instead of failing it.

The queue is bounded: the store's quotas (job_quota.py) admit a job only while fewer
than `--async-max-pending` are pending, and every pending job is in the queue at most
once. Every file operation runs in a thread (`asyncio.to_thread`): the event loop only
awaits it. A worker never dies of a job: whatever one job raises marks that job failed
with the reason (kept in memory when even that cannot be written) and the worker takes
the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from typing import Protocol

from tierguard.gate.admission import AdmissionController, AdmissionDecision, RequestInfo
from tierguard.gate.forward import UpstreamError
from tierguard.gate.jobs import DISK_FULL, PENDING, Job, JobStore
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
        self.queue: asyncio.Queue[str] = asyncio.Queue(maxsize=store.limits.max_pending)
        self.n_workers = workers
        self.failed_internal = 0  # jobs failed by an exception (a bug, a disk that refused a write)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> int:
        """Start workers and re-queue every pending job on disk; returns how many."""
        pending = await asyncio.to_thread(self.store.pending)
        # jobs left from a run with a higher --async-max-pending all fit; new ones wait for room
        self.queue = asyncio.Queue(maxsize=max(self.store.limits.max_pending, len(pending)))
        for job in pending:
            self.queue.put_nowait(job.id)
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.n_workers)]
        return len(pending)

    async def create(self, route: str, body: dict, input_tokens: int, owner: str | None) -> Job:
        """Write a new job (in a thread) and queue it. Raises JobRefused (a quota) or OSError
        (the write failed). A caller cancelled meanwhile (the client left) still gets its job
        queued once written: a job on disk is never left unqueued until a restart."""
        task = asyncio.ensure_future(asyncio.to_thread(self.store.create, route, body, input_tokens, owner))
        task.add_done_callback(self._created)
        return await asyncio.shield(task)

    def _created(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            self.submit(task.result())

    def submit(self, job: Job) -> None:
        try:
            self.queue.put_nowait(job.id)
        except asyncio.QueueFull:  # the quotas make this impossible; if not, the job reruns at the next start
            log.error("async job %s: the queue is full; it stays queued on disk", job.id)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _worker(self) -> None:
        while True:
            job_id = await self.queue.get()
            job = None
            try:
                job = await asyncio.to_thread(self.store.load, job_id)
                if job is None or job.status not in PENDING:
                    continue
                await self._run(job)
            except asyncio.CancelledError:
                raise  # shutdown: the job stays queued/running on disk and reruns at next start
            except Exception as exc:  # one job's failure, whatever it is, is that job's only
                log.exception("async job %s failed", job_id)
                self.failed_internal += 1
                if job is not None and job.status in PENDING:  # an end already recorded stays
                    status, reason = _failure(exc)
                    await self._finish(job, "failed", status, None, reason)

    async def _run(self, job: Job) -> None:
        info = RequestInfo(input_tokens=job.input_tokens,
                           priority="batch", background=True)
        try:
            ticket = await self.controller.acquire(info)
        except AdmissionDecision as d:
            await self._finish(job, "failed", getattr(d, "status", 429), None, d.message)
            return
        try:
            try:
                job.status, job.attempts = "running", job.attempts + 1
                await asyncio.to_thread(self.store.save, job)
                status, data = await self.upstream.post_json(job.route, job.body)
            finally:  # the slot goes back as the call ends: before any back-off, and on a bug too
                self.controller.release(ticket)
        except UpstreamError as exc:
            if exc.kind in ("unreachable", "engine_dead") and job.attempts < MAX_ATTEMPTS:
                job.status = "queued"
                await asyncio.to_thread(self.store.save, job)
                await asyncio.sleep(min(30.0, 0.5 * 2**job.attempts))
                self.submit(job)
                return
            await self._finish(job, "failed", exc.status, None, exc.message)
            return
        await self._finish(job, "succeeded" if status == 200 else "failed", status, data,
                           None if status == 200 else "upstream answered with an error")
        usage = data.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        self.reqlog.write(RequestRecord(route=job.route, model=job.body.get("model"), klass=ticket.klass,
                                        input_tokens=info.input_tokens,
                                        output_tokens=usage.get("completion_tokens"),
                                        queue_wait_ms=round(ticket.queue_wait_s * 1000, 3), decision="async",
                                        reason="job_run", status=status, job_id=job.id))

    async def _finish(self, job: Job, status: str, http_status: int, result: dict | None, error: str | None) -> None:
        """Record the end of a job. Never raises: when the state cannot be written, a failed
        state with the reason is written instead (smaller), and when that fails too it is
        kept in memory (`JobStore.remember`) so the client still learns why."""
        job.status, job.http_status, job.result, job.error = status, http_status, result, error
        try:
            await asyncio.to_thread(self.store.save, job)
            return
        except Exception as exc:
            log.warning("async job %s: cannot store its %s state: %s", job.id, status, exc)
            job.status, (job.http_status, job.error), job.result = "failed", _failure(exc), None
        try:
            await asyncio.to_thread(self.store.save, job)
        except Exception:
            self.store.remember(job)


def _failure(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and reason a job records for an exception."""
    if isinstance(exc, OSError) and exc.errno in DISK_FULL:
        return 507, f"cannot store the async job: the jobs directory is full ({os_reason(exc)})"
    if isinstance(exc, OSError):
        return 500, f"cannot store the async job: {os_reason(exc)}"
    return 500, f"internal error: {type(exc).__name__}"


def os_reason(exc: OSError) -> str:
    return exc.strerror or errno.errorcode.get(exc.errno or 0, "") or type(exc).__name__
