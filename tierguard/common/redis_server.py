"""A private `redis-server` (the Debian package) on a free loopback port, for tests and benches.

Real Redis, never a fake: the shared gate limits and the remote KV tier are judged
against the server users run. Each instance gets its own temporary directory and no
persistence, listens on 127.0.0.1 only, and is stopped (or killed with SIGKILL, the
crash case) by its owner; `restart()` brings it back on the same port, empty.

    with RedisServer() as r:
        r.url            # redis://127.0.0.1:PORT/0
        r.kill()         # SIGKILL
        r.restart()      # same port, fresh data

`redis_server_path()` is None when the package is missing: tests skip and say so
(`apt-get install redis-server`; `make test` installs it when run as root).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

INSTALL_HINT = "needs redis-server (Debian package redis-server: apt-get install -y redis-server)"


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping(port: int, timeout_s: float = 0.2) -> bool:
    """One `PING` over a raw socket: True on `+PONG`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, port: int | None = None, *, maxmemory: str | None = None, extra: list[str] | None = None):
        self.binary = redis_server_path()
        if self.binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.extra = list(extra or [])
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tierguard-redis-")
        d = Path(self._tmp.name)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(d),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes",
                "--logfile", str(d / "redis.log"), *self.extra]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if ping(self.port):
                return self
            time.sleep(0.02)
        log = (d / "redis.log").read_text(errors="replace")[-500:] if (d / "redis.log").exists() else ""
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING: {log}")

    def kill(self) -> None:
        """SIGKILL: the crash case (nothing is saved; the port is free at once)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
