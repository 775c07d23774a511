"""Asynchronous jobs on disk: the path for requests that can wait (R5, R8).

A job is one JSON file `<id>.json` in the jobs directory, rewritten atomically at each
state change (write a temp file, fsync it, rename over the old one, fsync the
directory), so a crash leaves either the old state or the new one, never half a file.

States: queued -> running -> succeeded | failed. On start, every job found `queued`
or `running` is queued again (a `running` job was cut off by the crash; running it
again is safe because completions have no side effects upstream). Who cleans files:
`sweep()` deletes finished jobs `ttl_s` after they finished (the gate runs it at start
and then periodically), and `load()` treats an expired job as gone.

The files hold the request body (prompts) and the answer (R15: data-residency duties
stay with the operator), so:
- they are created with mode 0600 in a directory of mode 0700;
- with a `KeyRing` they are sealed with AES-256-GCM (`common/crypto.py`, the job id as
  associated data) and named `<id>.job`; without one they are plain `<id>.json`. A file
  the configured keys cannot open is never served: `load()` answers None (counted);
- each job records its owner, the id of the API key that created it (`owner_id`, a
  hash, never the key); the gate serves a job only to that key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tierguard.common.crypto import DecryptError, KeyRing
from tierguard.common.errors import TierguardError

log = logging.getLogger("tierguard.gate")

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
    owner: str | None = None  # owner_id() of the API key that created it; None when the gate has no keys

    def public(self) -> dict:
        """What GET /v1/async/{id} returns: never the request body."""
        out = {"id": self.id, "object": "async.job", "status": self.status, "route": self.route,
               "created_at": self.created_at, "updated_at": self.updated_at, "attempts": self.attempts}
        if self.status in ("succeeded", "failed"):
            out.update({"http_status": self.http_status, "result": self.result, "error": self.error})
        return out


def owner_id(api_key: str) -> str:
    """Names the key that created a job without storing the key."""
    return hashlib.sha256(b"tierguard job owner\x00" + api_key.encode()).hexdigest()[:32]


class JobStore:
    """Files in one directory; every write is atomic. Single writer (one gate process)."""

    def __init__(self, directory: str | Path, ttl_s: float = 86400, keyring: KeyRing | None = None) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            if self.dir.stat().st_mode & 0o077:  # made by hand or by an older version: others stay out
                os.chmod(self.dir, 0o700)
        except OSError as exc:
            raise TierguardError(f"jobs directory {str(self.dir)!r}: {exc.strerror or exc}") from None
        self.ttl_s = ttl_s
        self.keyring = keyring
        self.suffix = ".job" if keyring is not None else ".json"
        self.undecryptable = 0  # loads refused because no configured key opens the file
        self.expired = 0  # finished jobs deleted after ttl_s
        self._warned: set[str] = set()

    @staticmethod
    def valid_id(job_id: str) -> bool:
        return bool(_ID.match(job_id))

    def create(self, route: str, body: dict, input_tokens: int, owner: str | None = None) -> Job:
        job = Job(id=f"job-{secrets.token_hex(16)}", route=route, body=body, input_tokens=input_tokens, owner=owner)
        self.save(job)
        return job

    def _aad(self, job_id: str) -> bytes:
        return b"tierguard job\x00" + job_id.encode()

    def save(self, job: Job) -> None:
        job.updated_at = time.time()
        path = self.dir / f"{job.id}{self.suffix}"
        tmp = self.dir / f".{job.id}.{secrets.token_hex(4)}.tmp"
        data = json.dumps(asdict(job)).encode()
        if self.keyring is not None:
            data = self.keyring.seal(data, self._aad(job.id))
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
        """The job, or None: unknown, unreadable, undecryptable, or finished longer than ttl_s ago."""
        if not self.valid_id(job_id):
            return None
        job = self._read(job_id)
        if job is not None and job.status not in PENDING and job.updated_at < time.time() - self.ttl_s:
            self._delete(self.dir / f"{job_id}{self.suffix}")
            return None
        return job

    def _read(self, job_id: str) -> Job | None:
        try:
            raw = (self.dir / f"{job_id}{self.suffix}").read_bytes()
        except OSError:
            return None
        if self.keyring is not None:
            try:
                raw = self.keyring.open(raw, self._aad(job_id))
            except DecryptError as exc:
                self.undecryptable += 1
                if job_id not in self._warned:  # once per job: a rotation gone wrong must not flood the log
                    self._warned.add(job_id)
                    log.warning("async job %s: %s", job_id, exc)
                return None
        try:
            return Job(**json.loads(raw))
        except (ValueError, TypeError):
            return None

    def _delete(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
            self.expired += 1

    def pending(self) -> list[Job]:
        """Jobs to run after a start, oldest first; leftover temp files are removed."""
        jobs = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    path.unlink()  # a write cut off by a crash; the old state is intact
                continue
            if path.suffix == self.suffix:
                job = self.load(path.stem)
                if job is not None and job.status in PENDING:
                    jobs.append(job)
        return sorted(jobs, key=lambda j: j.created_at)

    def sweep(self) -> int:
        """Delete finished jobs `ttl_s` after they finished; returns how many.

        A file's mtime is its last state change, so only files older than the cutoff are
        opened. Pending jobs stay whatever their age. Files that cannot be read as a job
        (no configured key opens them, damaged, or the other format: `.json` while a key
        is set, `.job` without one) go by their mtime alone."""
        cutoff, before = time.time() - self.ttl_s, self.expired
        for path in self.dir.glob("job-*"):
            try:
                if path.stat().st_mtime >= cutoff:
                    continue
            except OSError:
                continue
            job = self._read(path.stem) if path.suffix == self.suffix else None
            if job is None or job.status not in PENDING:
                self._delete(path)
        return self.expired - before
