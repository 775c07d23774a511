"""Quotas of async jobs: what the jobs directory may hold, per API key and in total.

Why: a job file holds its request body (up to the body limit, megabytes) and later its
answer, and stays until `--job-ttl-s` after it finished. Without a bound, any client
fills the disk, and a full disk stops every other client's jobs too.

Four limits (`JobLimits`), checked when a job is created, never when a job that is
already accepted changes state (its work is done; refusing to store it would lose it):

- pending jobs (queued or running) in total: the bound of the runner's queue; past it
  503 (`server_busy`) with Retry-After;
- pending jobs of one key: past it 429 (`rate_limit_exceeded`) with Retry-After;
- bytes of job files on disk in total (finished ones until they expire): 503;
- bytes of one key's job files: 429; a single job larger than that on its own: 413.

Without API keys there is one anonymous owner: only the totals apply. Files the gate
cannot read (another key, another format) count in the total bytes only.

`JobLedger` is the bookkeeping: filled from the directory when the store opens, then
kept by every write and delete. It is shared by the threads that write job files, so
every method takes its lock; `reserve` checks and records in one step, so two
concurrent submissions cannot both pass the last free place.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from tierguard.common.errors import TierguardError

MIB = 1024 * 1024
COUNT_RETRY_S = 5  # Retry-After when pending jobs are the limit: about one job's run


@dataclass(frozen=True)
class JobLimits:
    """Defaults fit a gate whose jobs hold prompts of up to the default 8 MiB body limit."""

    max_pending: int = 1024  # --async-max-pending: queued + running, all keys
    max_pending_per_key: int = 64  # --async-max-pending-per-key
    max_bytes: int = 4096 * MIB  # --async-max-bytes: job files on disk, all keys
    max_bytes_per_key: int = 512 * MIB  # --async-max-bytes-per-key

    def validate(self) -> JobLimits:
        for name in ("max_pending", "max_pending_per_key", "max_bytes", "max_bytes_per_key"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise TierguardError(f"async_{name} must be a positive whole number, got {value!r}")
        return self


class JobRefused(Exception):
    """A job the quotas do not allow: the HTTP status, a reason for logs and metrics, a
    message naming the limit, and when to retry (None: retrying cannot help)."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after_s = status, reason, message, retry_after_s


@dataclass
class _Entry:
    owner: str | None  # None: no API keys, or a file the gate cannot read
    nbytes: int
    pending: bool
    updated_at: float


class JobLedger:
    def __init__(self, limits: JobLimits, ttl_s: float) -> None:
        self.limits = limits
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._files: dict[str, _Entry] = {}  # by file name
        # running sums, so a check costs O(1) however many files there are
        self._pending = 0
        self._bytes = 0
        self._owner_pending: dict[str, int] = {}
        self._owner_bytes: dict[str, int] = {}

    def reserve(self, name: str, owner: str | None, nbytes: int) -> None:
        """Record a new pending job of `nbytes`, or raise JobRefused naming the limit it passes."""
        lim = self.limits
        with self._lock:
            if owner is not None:
                if nbytes > lim.max_bytes_per_key:
                    raise JobRefused(413, "job_too_large", f"this async job takes {nbytes} bytes on disk, more "
                                     f"than --async-max-bytes-per-key {lim.max_bytes_per_key}", None)
                n_mine = self._owner_pending.get(owner, 0)
                if n_mine >= lim.max_pending_per_key:
                    raise JobRefused(429, "quota_key_pending", f"async job quota: this key has {n_mine} jobs "
                                     f"pending, the limit is --async-max-pending-per-key "
                                     f"{lim.max_pending_per_key}", COUNT_RETRY_S)
                b_mine = self._owner_bytes.get(owner, 0)
                if b_mine + nbytes > lim.max_bytes_per_key:
                    raise JobRefused(429, "quota_key_bytes", f"async job quota: this key's jobs take {b_mine} "
                                     f"bytes on disk, {nbytes} more would pass --async-max-bytes-per-key "
                                     f"{lim.max_bytes_per_key}; finished results are deleted "
                                     f"{self.ttl_s:g} s after they finish", self._retry_s(owner))
            if nbytes > lim.max_bytes:
                raise JobRefused(413, "job_too_large", f"this async job takes {nbytes} bytes on disk, more than "
                                 f"--async-max-bytes {lim.max_bytes}", None)
            if self._pending >= lim.max_pending:
                raise JobRefused(503, "queue_full", f"the async job queue is full: {self._pending} jobs pending, "
                                 f"the limit is --async-max-pending {lim.max_pending}", COUNT_RETRY_S)
            if self._bytes + nbytes > lim.max_bytes:
                raise JobRefused(503, "quota_total_bytes", f"async jobs take {self._bytes} bytes on disk, {nbytes} "
                                 f"more would pass --async-max-bytes {lim.max_bytes}; finished results are deleted "
                                 f"{self.ttl_s:g} s after they finish", self._retry_s(None))
            self._put(name, _Entry(owner, nbytes, True, time.time()))

    def _retry_s(self, owner: str | None) -> int:
        """Until the oldest finished job (of `owner`; None: of anyone) expires and frees its bytes.
        A scan, but only on the way to a refusal."""
        done = [e.updated_at for e in self._files.values() if not e.pending and (owner is None or e.owner == owner)]
        if not done:
            return COUNT_RETRY_S
        return max(1, min(math.ceil(self.ttl_s), math.ceil(min(done) + self.ttl_s - time.time())))

    def set(self, name: str, owner: str | None, nbytes: int, pending: bool, updated_at: float) -> None:
        with self._lock:
            self._put(name, _Entry(owner, nbytes, pending, updated_at))

    def drop(self, name: str) -> None:
        with self._lock:
            self._take(name)

    def totals(self) -> tuple[int, int]:
        """(pending jobs, bytes on disk), all owners."""
        with self._lock:
            return self._pending, self._bytes

    def _put(self, name: str, e: _Entry) -> None:
        self._take(name)
        self._files[name] = e
        self._add(e, 1)

    def _take(self, name: str) -> None:
        old = self._files.pop(name, None)
        if old is not None:
            self._add(old, -1)

    def _add(self, e: _Entry, sign: int) -> None:
        self._pending += sign * e.pending
        self._bytes += sign * e.nbytes
        if e.owner is not None:
            self._owner_pending[e.owner] = self._owner_pending.get(e.owner, 0) + sign * e.pending
            self._owner_bytes[e.owner] = self._owner_bytes.get(e.owner, 0) + sign * e.nbytes
            if not self._owner_bytes[e.owner] and not self._owner_pending[e.owner]:
                del self._owner_bytes[e.owner], self._owner_pending[e.owner]
