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

What the directory may hold is bounded per key and in total (job_quota.py): `create`
refuses a job past a quota with `JobRefused`. Every method does blocking file I/O
(serialise, seal, write, fsync, rename): the gate calls them from worker threads, never
on its event loop. A write either completes (a short write is continued until every
byte is out) or raises `OSError` with the temp file removed; a full disk (ENOSPC,
EDQUOT) is counted in `disk_full`, other errors in `write_errors`. A state the runner
could not write (`remember`) is served from memory until a later write succeeds or it
expires, so a client learns that its job failed even when the disk could not say so.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from tierguard.common.crypto import DecryptError, KeyRing
from tierguard.common.errors import TierguardError
from tierguard.gate.job_quota import JobLedger, JobLimits, JobRefused

log = logging.getLogger("tierguard.gate")

_ID = re.compile(r"^job-[0-9a-f]{32}$")
PENDING = ("queued", "running")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


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


def write_all(fd: int, data: bytes | memoryview) -> None:
    """`os.write` until every byte is out: a short write (a signal, a nearly full disk) is
    continued, and a write that makes no progress is a full disk."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


class JobStore:
    """Files in one directory; every write is atomic. Single writer process (one gate);
    safe to call from several threads of it."""

    def __init__(self, directory: str | Path, ttl_s: float = 86400, keyring: KeyRing | None = None,
                 limits: JobLimits | None = None) -> None:
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
        self.limits = (limits or JobLimits()).validate()
        self.ledger = JobLedger(self.limits, ttl_s)
        self.undecryptable = 0  # loads refused because no configured key opens the file
        self.expired = 0  # finished jobs deleted after ttl_s
        self.disk_full = 0  # writes that failed with ENOSPC / EDQUOT
        self.write_errors = 0  # writes that failed otherwise
        self.refused: dict[str, int] = {}  # creations refused by a quota, by reason
        self._lock = threading.Lock()
        self._unsaved: dict[str, Job] = {}  # states the runner could not write (see `remember`)
        self._warned: set[str] = set()
        self._scan()

    @staticmethod
    def valid_id(job_id: str) -> bool:
        return bool(_ID.match(job_id))

    def create(self, route: str, body: dict, input_tokens: int, owner: str | None = None) -> Job:
        """A new queued job, written; raises JobRefused past a quota (nothing written) or
        OSError when the write fails (nothing left behind)."""
        job = Job(id=f"job-{secrets.token_hex(16)}", route=route, body=body, input_tokens=input_tokens, owner=owner)
        data = self._encode(job)
        name = f"{job.id}{self.suffix}"
        try:
            self.ledger.reserve(name, owner, len(data))
        except JobRefused as exc:
            with self._lock:
                self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
            raise
        try:
            self._write(job.id, data)
        except BaseException:
            self.ledger.drop(name)
            raise
        return job

    def _aad(self, job_id: str) -> bytes:
        return b"tierguard job\x00" + job_id.encode()

    def _encode(self, job: Job) -> bytes:
        job.updated_at = time.time()
        # shallow (asdict would copy the body recursively, and a deeply nested body past
        # Python's recursion limit); json's C encoder walks it once
        data = json.dumps({f.name: getattr(job, f.name) for f in fields(job)}).encode()
        return self.keyring.seal(data, self._aad(job.id)) if self.keyring is not None else data

    def save(self, job: Job) -> None:
        """Write the job's current state; raises OSError when it cannot (the old state stays)."""
        data = self._encode(job)
        self._write(job.id, data)
        self.ledger.set(f"{job.id}{self.suffix}", job.owner, len(data), job.status in PENDING, job.updated_at)
        with self._lock:
            self._unsaved.pop(job.id, None)

    def remember(self, job: Job) -> None:
        """Serve this state of `job` from memory (without its body): the runner's write of it failed."""
        kept = replace(job, body={}, updated_at=time.time())
        with self._lock:
            self._unsaved[job.id] = kept

    def _write(self, job_id: str, data: bytes) -> None:
        path = self.dir / f"{job_id}{self.suffix}"
        tmp = self.dir / f".{job_id}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)  # the rename itself must survive a power cut
            finally:
                os.close(dfd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()  # a full disk gets its space back at once
            with self._lock:
                if exc.errno in DISK_FULL:
                    self.disk_full += 1
                else:
                    self.write_errors += 1
            raise

    def load(self, job_id: str) -> Job | None:
        """The job, or None: unknown, unreadable, undecryptable, or finished longer than ttl_s ago."""
        if not self.valid_id(job_id):
            return None
        with self._lock:
            job = self._unsaved.get(job_id)
        if job is not None:
            if job.updated_at < time.time() - self.ttl_s:
                with self._lock:
                    self._unsaved.pop(job_id, None)
                return None
            return replace(job)
        job = self._read(job_id)
        if job is not None and job.status not in PENDING and job.updated_at < time.time() - self.ttl_s:
            self._delete(self.dir / f"{job_id}{self.suffix}")
            return None
        return job

    def _read(self, job_id: str, quiet: bool = False) -> Job | None:
        try:
            raw = (self.dir / f"{job_id}{self.suffix}").read_bytes()
        except OSError:
            return None
        if self.keyring is not None:
            try:
                raw = self.keyring.open(raw, self._aad(job_id))
            except DecryptError as exc:
                if quiet:
                    return None
                with self._lock:
                    self.undecryptable += 1
                    first = job_id not in self._warned
                    self._warned.add(job_id)
                if first:  # once per job: a rotation gone wrong must not flood the log
                    log.warning("async job %s: %s", job_id, exc)
                return None
        try:
            return Job(**json.loads(raw))
        except (ValueError, TypeError):
            return None

    def _delete(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
            self.ledger.drop(path.name)
            with self._lock:
                self.expired += 1

    def _scan(self) -> None:
        """Fill the ledger from the directory; leftover temp files (a write cut off by a
        crash: the old state is intact) are removed."""
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if not path.name.startswith("job-"):
                continue
            try:
                st = path.stat()
            except OSError:
                continue
            job = self._read(path.stem, quiet=True) if path.suffix == self.suffix else None
            if job is None:  # not ours to read: it takes space all the same
                self.ledger.set(path.name, None, st.st_size, False, st.st_mtime)
            else:
                self.ledger.set(path.name, job.owner, st.st_size, job.status in PENDING, job.updated_at)

    def pending(self) -> list[Job]:
        """Jobs to run after a start, oldest first."""
        jobs = []
        for path in self.dir.glob("job-*" + self.suffix):
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
        with self._lock:
            for job_id in [i for i, j in self._unsaved.items() if j.updated_at < cutoff]:
                del self._unsaved[job_id]
        return self.expired - before
