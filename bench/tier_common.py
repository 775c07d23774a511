"""Shared by the tier benchmarks: a `tierguard serve` subprocess, a streaming client, /metrics.

The client sends /v1/completions with token-id prompts (no tokenizer round trip, exact
lengths), greedy and `ignore_eos`, and records when each content event arrives. TTFT is
send -> first event; ITL is the gap between consecutive events of one stream.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tierguard.cli.serve import READY_PREFIX as READY
from tierguard.common.percentile import percentile
from tierguard.common.proc import ReadyProcess

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = Path(tempfile.gettempdir()) / "tierguard_bench_logs"


@dataclass
class Stream:
    name: str
    sent: float
    events: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""  # the streamed completion (greedy: equal runs must give equal text)

    @property
    def ttft_s(self) -> float | None:
        return self.events[0] - self.sent if self.events else None

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:], strict=False)]


pct = percentile  # q in 0..100, None for no values: the one definition (common/percentile.py)


def ms(v: float | None) -> float | None:
    return None if v is None else round(1000 * v, 2)


@contextlib.contextmanager
def serve(name: str, flags: list[str], env: dict[str, str] | None = None, model: str = "tiny") -> Iterator[str]:
    """Start `tierguard serve --port 0 ...`, yield its base URL, stop it with SIGTERM."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tierguard", "serve", "--model", model, "--port", "0", *flags]
    child = ReadyProcess(
        cmd, READY, env={"PYTHONPATH": str(ROOT), **(env or {})},
        stderr_path=LOG_DIR / f"{name}.stderr.log", grace_s=60.0,
    )  # fmt: skip
    with child:
        yield child.start(timeout_s=300).split()[0]


async def stream_completion(
    session: aiohttp.ClientSession, url: str, name: str, prompt: list[int], max_tokens: int, **extra
) -> Stream:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }
    s = Stream(name, time.perf_counter())
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return s
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                texts = [c.get("text") or "" for c in chunk.get("choices") or []]
                if any(texts):
                    s.events.append(time.perf_counter())
                    s.text += "".join(texts)
    except aiohttp.ClientError as e:
        s.error = str(e)
    return s


async def scrape(session: aiohttp.ClientSession, url: str, prefix: str = "tierguard:engine_kv_") -> dict:
    """Samples whose names start with `prefix` (label-free values), plus preemptions;
    counters are keyed without their `_total` suffix (the engine's own counter names)."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith(prefix):
            out[name.removeprefix("tierguard:engine_").removesuffix("_total")] = float(line.rsplit(" ", 1)[1])
        elif name in ("vllm:num_preemptions_total", "vllm:num_preemptions"):
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def token_prompt(seed: int, n: int, vocab: int = 4000) -> list[int]:
    """A deterministic prompt of `n` token ids (distinct per seed, no prefix sharing)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]
