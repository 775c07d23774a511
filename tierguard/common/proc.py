"""A child server that announces itself with one line on stdout.

`tierguard serve`, `tierguard gate` and the schedule server each print exactly one ready
line (with the bound port, so `--port 0` works) and stop on SIGTERM. Tests, benchmarks
and the sweep start them the same way, so the waiting and the stopping live here once:

- the ready line is awaited with a real deadline (a reader thread, not a blocking
  `readline()` that could hang forever on a child that never prints);
- stdout is drained afterwards, so a chatty child can never block on a full pipe;
- stop is SIGTERM, then SIGKILL to the whole process group after a grace period;
  `kill()` is the crash case (SIGKILL at once, nothing cleans up).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO


class ReadyProcess:
    """Start `args`; `start()` returns the ready line's text after `ready_prefix`."""

    def __init__(
        self,
        args: Sequence[str],
        ready_prefix: str,
        *,
        env: Mapping[str, str] | None = None,
        stderr_path: str | Path | None = None,
        grace_s: float = 30.0,
    ) -> None:
        self.args = list(args)
        self.ready_prefix = ready_prefix
        self.env = {**os.environ, **(env or {})}
        self.stderr_path = Path(stderr_path) if stderr_path is not None else None
        self.grace_s = grace_s
        self.proc: subprocess.Popen | None = None
        self._err: IO[str] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("process not started")
        return self.proc.pid

    def start(self, timeout_s: float = 60.0) -> str:
        if self.stderr_path is not None:
            self._err = open(self.stderr_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=self._err, text=True, env=self.env,
            start_new_session=True,
        )  # fmt: skip
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout, lines), daemon=True).start()
        try:
            while True:
                line = lines.get(timeout=timeout_s)
                if line.startswith(self.ready_prefix):
                    return line[len(self.ready_prefix) :].strip()
                if line == "":  # EOF: the child exited before it was ready
                    break
        except queue.Empty:
            pass
        self.stop()
        raise RuntimeError(f"{' '.join(self.args[:4])}… did not print {self.ready_prefix!r}: {self.stderr_tail()}")

    @staticmethod
    def _pump(stream: IO[str] | None, lines: queue.Queue[str]) -> None:
        if stream is None:
            return
        for line in stream:
            lines.put(line)
        lines.put("")

    def stderr_tail(self, chars: int = 2000) -> str:
        if self.stderr_path is None or not self.stderr_path.exists():
            return "(stderr not captured)"
        return self.stderr_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the process group after the grace period."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._close_err()

    def kill(self) -> None:
        """The crash case: SIGKILL at once."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_err()

    def _close_err(self) -> None:
        if self._err is not None:
            self._err.close()
            self._err = None

    def __enter__(self) -> ReadyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
