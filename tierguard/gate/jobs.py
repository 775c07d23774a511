"""Asynchronous jobs on disk: the path for requests that can wait (R5, R8).

A job is one JSON file `<id>.json` in the jobs directory, rewritten atomically at each
state change (write a temp file, fsync it, rename over the old one, fsync the
directory), so a crash leaves either the old state or the new one, never half a file.

States: queued -> running -> succeeded | failed. On start, every job found `queued`
or `running` is queued again (a `running` job was cut off by the crash; running it
again is safe because completions have no side effects upstream). Who cleans files:
finished jobs older than `retention_s` are deleted by `sweep()` at start.

The files hold the request body (prompts) and the answer, so they are created with
mode 0600; job ids are 128-bit random, so knowing one is what grants access to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_ID = re.compile(r"^job-[0-9a-f]{32}$")
PENDING = ("queued", "running")


@dataclass
class Job:
    id: str
    route: str  # upstream path, e.g. /v1/chat/completions
    body: dict
    input_tokens: int = 0  # counted at submission; decides the class when it runs
    status: str = "queued"
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    attempts: int = 0
    http_status: int | None = None
    result: dict | None = None
    error: str | None = None

    def public(self) -> dict:
        """What GET /v1/async/{id} returns: never the request body."""
        out = {"id": self.id, "object": "async.job", "status": self.status, "route": self.route,
               "created_at": self.created_at, "updated_at": self.updated_at, "attempts": self.attempts}
        if self.status in ("succeeded", "failed"):
            out.update({"http_status": self.http_status, "result": self.result, "error": self.error})
        return out


class JobStore:
    """Files in one directory; every write is atomic. Single writer (one gate process)."""

    def __init__(self, directory: str | Path, retention_s: float = 7 * 86400) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.retention_s = retention_s

    @staticmethod
    def valid_id(job_id: str) -> bool:
        return bool(_ID.match(job_id))

    def create(self, route: str, body: dict, input_tokens: int) -> Job:
        job = Job(id=f"job-{secrets.token_hex(16)}", route=route, body=body, input_tokens=input_tokens)
        self.save(job)
        return job

    def save(self, job: Job) -> None:
        job.updated_at = time.time()
        path = self.dir / f"{job.id}.json"
        tmp = self.dir / f".{job.id}.{secrets.token_hex(4)}.tmp"
        data = json.dumps(asdict(job)).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself must survive a power cut
        finally:
            os.close(dfd)

    def load(self, job_id: str) -> Job | None:
        if not self.valid_id(job_id):
            return None
        try:
            data = json.loads((self.dir / f"{job_id}.json").read_text(encoding="utf-8"))
            return Job(**data)
        except (OSError, ValueError, TypeError):
            return None

    def pending(self) -> list[Job]:
        """Jobs to run after a start, oldest first; leftover temp files are removed."""
        jobs = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    path.unlink()  # a write cut off by a crash; the old state is intact
                continue
            if path.suffix == ".json":
                job = self.load(path.stem)
                if job is not None and job.status in PENDING:
                    jobs.append(job)
        return sorted(jobs, key=lambda j: j.created_at)

    def sweep(self) -> int:
        """Delete finished jobs older than the retention; returns how many."""
        cutoff, removed = time.time() - self.retention_s, 0
        for path in self.dir.glob("job-*.json"):
            job = self.load(path.stem)
            if job is not None and job.status not in PENDING and job.updated_at < cutoff:
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += 1
        return removed
