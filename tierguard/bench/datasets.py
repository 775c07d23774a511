"""Workloads: the list of requests a run sends, fully determined by config and seed.

Every dataset yields `RequestSpec`s with a prompt of a known token count (exact with a
tokenizer), an output length, and optionally its own arrival offset (trace replay).
Because the list is deterministic, the profile fingerprint can be computed from it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierguard.bench.config import BenchConfig
from tierguard.bench.prompts import PromptMaker
from tierguard.common.errors import TierguardError, read_text


@dataclass
class RequestSpec:
    index: int
    prompt: str
    input_len: int  # counted with the run's token counter (see run.json prompts.exact)
    output_len: int
    group: str = ""  # "long"/"short", "prefix-3", "session-2/turn-1"
    arrival_s: float | None = None  # only for trace replay

    @property
    def prompt_sha(self) -> str:
        return hashlib.sha256(self.prompt.encode()).hexdigest()[:16]


def _lengths(mean: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """Uniform in [mean×(1−ratio), mean×(1+ratio)], at least 1."""
    if ratio <= 0:
        return [mean] * n
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def _spec(maker: PromptMaker, i: int, n_in: int, n_out: int, rng, group: str = "", head=None) -> RequestSpec:
    text, _ = maker.text_of_length(n_in, rng, head)
    return RequestSpec(i, text, maker.count(text), n_out, group)


def build_requests(cfg: BenchConfig, maker: PromptMaker, count: int) -> list[RequestSpec]:
    """`count` requests of the configured dataset (trace and sessions fix their own count)."""
    rng = np.random.default_rng(cfg.seed)
    ds = cfg.dataset
    if ds in ("random", "fixed"):
        ratio = cfg.range_ratio
        ins, outs = _lengths(cfg.input_len, ratio, count, rng), _lengths(cfg.output_len, ratio, count, rng)
        return [_spec(maker, i, ins[i], outs[i], rng) for i in range(count)]
    if ds == "mixed":
        # A constant share: exactly round(share × count) long requests, spread evenly.
        n_long = round(cfg.long_share * count)
        long_idx = set(np.linspace(0, count - 1, n_long, dtype=int).tolist()) if n_long else set()
        return [
            _spec(maker, i, cfg.long_input_len if i in long_idx else cfg.input_len, cfg.output_len, rng,
                  "long" if i in long_idx else "short")
            for i in range(count)
        ]
    if ds == "shared-prefix":
        prefixes = [maker.text_of_length(cfg.prefix_len, rng)[1] for _ in range(cfg.num_prefixes)]
        total = cfg.num_prefixes * cfg.requests_per_prefix
        out = []
        for i in range(total):
            p = i % cfg.num_prefixes  # interleaved: reuse distance = num_prefixes
            out.append(_spec(maker, i, cfg.prefix_len + cfg.input_len, cfg.output_len, rng, f"prefix-{p}", prefixes[p]))
        return out
    if ds == "sessions":
        return _sessions(cfg, maker, rng)
    if ds == "trace":
        return _trace(cfg, maker, rng)
    raise TierguardError(f"unknown dataset {ds!r}")


def _sessions(cfg: BenchConfig, maker: PromptMaker, rng) -> list[RequestSpec]:
    """Multi-turn conversations: turn t's prompt is the whole history plus a new message.

    The assistant replies in the history are synthetic (output_len units), so prompts do
    not depend on what the server generated and the profile stays reproducible. Turns are
    interleaved across sessions, so a session's history is reused after `num_sessions`
    other requests (the reuse distance); the KV working set grows with turns.
    """
    history: list[list] = [[] for _ in range(cfg.num_sessions)]
    out: list[RequestSpec] = []
    for turn in range(cfg.turns):
        for s in range(cfg.num_sessions):
            head = history[s]
            n_in = len(head) + cfg.input_len
            text, units = maker.text_of_length(n_in, rng, head)
            out.append(RequestSpec(len(out), text, maker.count(text), cfg.output_len, f"session-{s}/turn-{turn}"))
            history[s] = units + maker.random_units(cfg.output_len, rng)
    return out


def _trace(cfg: BenchConfig, maker: PromptMaker, rng) -> list[RequestSpec]:
    """JSONL rows: arrival (`arrival_s` seconds, or `timestamp` milliseconds as in the
    Mooncake traces), input length and output length under common key names."""
    path = Path(str(cfg.trace))
    if not path.is_file():
        raise TierguardError(f"--trace {path}: no such file")
    rows = []
    for n, line in enumerate(read_text(path, "--trace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            t = float(row["arrival_s"]) if "arrival_s" in row else float(row["timestamp"]) / 1000.0
            n_in = int(next(row[k] for k in ("input_len", "input_length", "input_tokens") if k in row))
            n_out = int(next(row[k] for k in ("output_len", "output_length", "output_tokens") if k in row))
        except (ValueError, KeyError, StopIteration, TypeError):
            raise TierguardError(
                f"--trace {path}:{n}: expected JSON with arrival_s (or timestamp in ms), input_len and output_len"
            ) from None
        if n_in <= 0 or n_out <= 0:
            raise TierguardError(f"--trace {path}:{n}: lengths must be positive")
        rows.append((t, n_in, n_out))
    if not rows:
        raise TierguardError(f"--trace {path}: no requests in file")
    rows.sort()
    t0 = rows[0][0]
    specs = []
    for i, (t, n_in, n_out) in enumerate(rows):
        s = _spec(maker, i, n_in, n_out, rng)
        s.arrival_s = t - t0
        specs.append(s)
    return specs


def natural_count(cfg: BenchConfig) -> int | None:
    """Datasets whose shape fixes the number of requests."""
    if cfg.dataset == "shared-prefix":
        return cfg.num_prefixes * cfg.requests_per_prefix
    if cfg.dataset == "sessions":
        return cfg.num_sessions * cfg.turns
    return None
