"""Writes of the disk tier suspended, and resumed once a probe shows the cause is gone.

Disk full (ENOSPC, EDQUOT), a directory not writable (EACCES, EPERM, EROFS) or
`max_consecutive_write_errors` failures in a row suspend writes: `healthy` turns False
with a `reason`, reads of existing blocks go on. A cause like these passes (an operator
frees space, fixes a mode, remounts), so the tier does not give up: a probe thread of
its own (never the engine's thread or an event loop) writes a file as large as the write
that failed (at least 4 KiB, at most 64 MiB: "a block fits again", not "a page fits"),
fsyncs and removes it, first after `probe_interval_s`, then twice as long after each failure up to
`probe_max_interval_s`. The first probe that succeeds resumes writes. The wait is not
reset by a resume, only by a real write that succeeds, so a disk that fills again at once
is probed ever less often instead of failing a write a second.

Counted: `writes_disabled` (suspensions), `writes_reenabled` (resumptions),
`write_probes` and `write_probe_failures`. A directory that could not be opened at all
(missing, a symlink, a file) is not probed: that is a configuration to fix and restart.

`WriteRecovery` is a mixin of `DiskTier` (tier.py), split out to keep one concern per
file; it works on the tier's state under the tier's lock.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from typing import Any

from tierguard.kv.media.disk import format as fmt

log = logging.getLogger("tierguard.kv.disk")

PROBE_BYTES = 4096
MAX_PROBE_BYTES = 64 << 20
_ZEROS = bytes(1 << 20)
_FULL = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def suspend_reason(e: OSError, streak: int, limit: int) -> str | None:
    """Why this write error suspends writes, or None if it does not (yet)."""
    if e.errno in _FULL:
        return f"disk full ({e.strerror})"
    if e.errno in _NOT_WRITABLE:
        return f"directory not writable ({e.strerror})"
    if streak >= limit:
        return f"{streak} consecutive write errors, last: {e.strerror}"
    return None


class WriteRecovery:
    """Suspend, probe, resume (see the module docstring). `self` is the DiskTier."""

    def _suspend_locked(self: Any, reason: str) -> None:
        """Suspend writes (caller holds `self._lock`) and make sure a probe thread runs."""
        self.healthy = False
        self.reason = f"{reason}; writes disabled until a probe write succeeds"
        if self.writes_enabled:
            self.writes_enabled = False
            self._c["writes_disabled"] += 1
            log.warning("disk tier %s: %s", self.fingerprint, self.reason)
        if self._prober is None and not self._closed.is_set():
            self._prober = threading.Thread(
                target=_probe_loop, args=(weakref.ref(self), self._closed),
                name=f"kv-disk-probe-{self.fingerprint}", daemon=True,
            )  # fmt: skip
            self._prober.start()

    def probe(self: Any) -> bool:
        """One probe: write, fsync and remove a small file; True (writes resumed) if it worked."""
        dir_fd = self._dir_fd  # close() joins this thread before it closes the descriptor
        if dir_fd is None:
            return False
        name = fmt.temp_name(0, os.getpid(), next(self._seq))
        try:
            self.faults.check("disk.write")
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | fmt.OPEN_FLAGS, 0o600, dir_fd=dir_fd)
            try:
                left = min(max(PROBE_BYTES, self._probe_bytes), MAX_PROBE_BYTES)
                while left:
                    self._write_all(fd, memoryview(_ZEROS)[: min(left, len(_ZEROS))])
                    left -= min(left, len(_ZEROS))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
        except OSError as e:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                pass
            with self._lock:
                self._c["write_probes"] += 1
                self._c["write_probe_failures"] += 1
                self._probe_wait = min(self._probe_wait * 2, self.probe_max_interval_s)
                cause = self.reason.split(";")[0]
                self.reason = (
                    f"{cause}; writes disabled until a probe write succeeds (last: {e.strerror or e})"
                )
            return False
        with self._lock:
            self._c["write_probes"] += 1
            self._consecutive_write_errors = 0
            if not self.writes_enabled:
                self._c["writes_reenabled"] += 1
                log.warning("disk tier %s: a probe write succeeded; writes resumed", self.fingerprint)
            self.writes_enabled = self.healthy = True
            self.reason = ""
            if self._prober is threading.current_thread():
                self._prober = None  # under the lock: a suspension from now on starts a new one
        return True


def stop_prober(tier: Any) -> None:
    """Stop the probe thread (close() calls it before closing the directory)."""
    tier._closed.set()
    prober = tier._prober
    if prober is not None and prober is not threading.current_thread():
        prober.join(timeout=10)


def _probe_loop(ref: weakref.ref, closed: threading.Event) -> None:
    """Probe until writes resume, the tier closes, or it is collected (a weak reference:
    this thread never keeps a dropped tier alive)."""
    while True:
        tier = ref()
        if tier is None:
            return
        wait = tier._probe_wait
        del tier
        if closed.wait(wait):
            return
        tier = ref()
        if tier is None:
            return
        try:
            if tier.probe():
                return
        except Exception:  # a probe that fails oddly is retried, never fatal
            log.exception("disk tier probe failed")
        del tier
