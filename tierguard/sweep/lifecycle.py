"""Engine lifecycle for one variant: start -> wait for health -> warm up -> stop.

Invariants:
- A managed engine runs in its own process group, so stop() reaches the workers it
  spawned too: SIGTERM to the group, SIGKILL after `stop_grace_s`.
- Its stdout/stderr go to `engine.log` in the variant's directory, and what it says
  about itself (version, models, command, port) to `engine.json`; both survive a crash.
- A start that fails raises EngineStartError naming the reason and the log's tail;
  the sweep records the variant as failed and carries on.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tierguard.common.errors import TierguardError
from tierguard.sweep.matrix import Profile, Variant

_MODEL_DIR = re.compile(r"\{model_dir:([A-Za-z0-9_.~/-]+)\}")


class EngineStartError(Exception):
    """The engine did not become healthy; the message says why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when the server could not be reached."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback URLs from the matrix
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, ""


def http_post_json(url: str, body: dict, timeout: float = 60.0) -> tuple[int, str]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        return 0, str(exc)


def fill(template: str, subst: dict[str, str]) -> str:
    """Replace only our placeholders (port, base_url, python, workdir, model_dir:NAME): engine
    flags often carry JSON braces, so str.format would break them. `{model_dir:smollm2}` is the
    local HF directory tierguard serves for that name (imported once), for engines that load
    directories: the same weights on both sides of a comparison."""
    for key, value in subst.items():
        template = template.replace("{" + key + "}", value)
    if "{model_dir:" in template:
        from tierguard.model.registry import resolve_model

        try:
            template = _MODEL_DIR.sub(lambda m: str(resolve_model(m[1])), template)
        except TierguardError as exc:
            raise EngineStartError(str(exc)) from None
    return template


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


@dataclass
class Engine:
    """One running (or reachable) engine for a variant."""

    variant: Variant
    workdir: Path
    base_url: str = ""
    model: str | None = None
    info: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    _log: object | None = None

    def start(self, profile: Profile) -> Engine:
        self.workdir.mkdir(parents=True, exist_ok=True)
        v = self.variant
        port = free_port() if v.managed else 0
        self.base_url = (v.base_url or f"http://127.0.0.1:{port}").rstrip("/")
        # {python} is this interpreter, so `{python} -m tierguard serve` uses the same venv.
        # {workdir} is this variant's directory in the run (engine logs, a disk tier's files).
        subst = {
            "port": str(port),
            "base_url": self.base_url,
            "python": sys.executable,
            "workdir": str(self.workdir.resolve()),
        }
        health = fill(v.health_url, subst)
        self.info = {
            "variant": v.name,
            "base_url": self.base_url,
            "health_url": health,
            "managed": v.managed,
            "started_at": time.time(),
        }
        if v.managed:
            argv = self._argv(subst)
            self.info["command"] = argv
            env = {**os.environ, **{k: fill(val, subst) for k, val in v.env.items()}}
            self._log = open(self.workdir / "engine.log", "ab")  # noqa: SIM115 - closed in stop()
            try:
                self.proc = subprocess.Popen(
                    argv,
                    stdout=self._log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=v.cwd,
                    start_new_session=True,
                )
            except OSError as exc:
                self._close_log()
                raise EngineStartError(f"cannot run {argv[0]!r}: {exc.strerror or exc}") from None
            self.info["pid"] = self.proc.pid
        try:
            self._wait_healthy(health, v.start_timeout_s)
            self._describe(profile)
            self._warm_up(profile)
        except EngineStartError:
            self.stop()
            self._save()
            raise
        self.info["ready_s"] = round(time.time() - self.info["started_at"], 3)
        self._save()
        return self

    def _argv(self, subst: dict[str, str]) -> list[str]:
        cmd = self.variant.command
        parts = shlex.split(cmd) if isinstance(cmd, str) else list(cmd or [])
        if not parts:
            raise EngineStartError("empty command")
        return [fill(p, subst) for p in parts]

    def _wait_healthy(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineStartError(
                    f"engine exited with code {self.proc.returncode} before it was healthy; "
                    f"log: {_tail(self.workdir / 'engine.log')}"
                )
            status, _ = http_get(url, timeout=2.0)
            if status == 200:
                return
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)
        raise EngineStartError(
            f"no healthy answer from {url} within {timeout_s:g}s; log: {_tail(self.workdir / 'engine.log')}"
        )

    def _describe(self, profile: Profile) -> None:
        """Record the engine's version and served models; pick the model name to request."""
        status, body = http_get(f"{self.base_url}/version")
        if status == 200:
            self.info["version"] = _json_or_text(body)
        status, body = http_get(f"{self.base_url}/v1/models")
        models: list[str] = []
        if status == 200:
            data = _json_or_text(body)
            if isinstance(data, dict):
                models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict) and m.get("id")]
        self.info["models"] = models
        self.model = self.variant.model or profile.model or (models[0] if models else None)
        self.info["model"] = self.model

    def _warm_up(self, profile: Profile) -> None:
        """A few short requests so that lazy initialisation is not measured by the first cell."""
        url = f"{self.base_url}{profile.endpoint}"
        ok = 0
        for _ in range(self.variant.warmup_requests):
            body: dict = {"max_tokens": 4, "temperature": 0.0, "stream": False}
            if self.model:
                body["model"] = self.model
            if profile.endpoint.endswith("chat/completions"):
                body["messages"] = [{"role": "user", "content": "warm up"}]
            else:
                body["prompt"] = "warm up"
            status, _ = http_post_json(url, body, timeout=min(profile.timeout_s, 300.0))
            ok += status == 200
        self.info["warmup"] = {"sent": self.variant.warmup_requests, "ok": ok}
        if self.variant.warmup_requests and ok == 0:
            raise EngineStartError(f"every warm-up request to {url} failed")

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period. Idempotent."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            t0 = time.monotonic()
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(self.variant.stop_grace_s)
                self.info["stop"] = "sigterm"
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
                self.info["stop"] = "sigkill"
            self.info["stop_s"] = round(time.monotonic() - t0, 3)
        if proc is not None:
            self.info["exit_code"] = proc.returncode
            _signal_group(proc, signal.SIGKILL)  # leftovers of the group, if any
        self._close_log()
        if self.info:
            self._save()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None

    def _save(self) -> None:
        (self.workdir / "engine.json").write_text(json.dumps(self.info, indent=2, default=str))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _json_or_text(body: str) -> object:
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:500]
