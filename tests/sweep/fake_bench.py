"""A stand-in for `tierguard bench` for fast runner tests: writes a result directory
in the bench's documented shape, from a closed-form model of a server with a fixed
capacity (requests beyond it wait for a whole request's time).

Requests differ the way real ones do, so statistics that mix them are exercised: each
request has its own TTFT jitter and its own token cadence (`itl_spread`, a share of
`itl_ms`), every `stall_every`-th request one long gap of `stall_ms` mid-stream, and a
failed request (every `fail_every`-th) fails after `fail_after_tokens` tokens, as a
stream cut by the server does (0: before its first token)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierguard.bench.records import FAILED, OK, RequestRecord
from tierguard.sweep.benchcall import BenchOutcome

PROFILE_FLAGS = (
    "--dataset",
    "--input-len",
    "--output-len",
    "--max-concurrency",
    "--num-requests",
    "--seed",
    "--temperature",
    "--long-share",
    "--long-input-len",
    "--request-rate",
)


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


@dataclass
class ServerModel:
    capacity: int = 4
    ttft_ms: float = 50.0
    itl_ms: float = 20.0
    prefill_ms_per_token: float = 0.0
    fail_every: int = 0  # every n-th request fails
    fail_after_tokens: int | None = None  # tokens a failed request streams first; None: half of them
    itl_spread: float = 0.2  # each request's own cadence: itl_ms x (1 +- spread)
    stall_every: int = 0  # every n-th request has one long gap before its middle token
    stall_ms: float = 0.0
    calls: list[list[str]] = field(default_factory=list)
    profile_override: dict = field(default_factory=dict)


def write_results(out: Path, records: list[RequestRecord], profile: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")
    fp = hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()[:12]
    (out / "run.json").write_text(json.dumps({"profile": profile, "fingerprint": fp}))
    ok = [r for r in records if r.ok]
    (out / "summary.json").write_text(json.dumps({"completed": len(ok), "failed": len(records) - len(ok)}))


def make_bench(model: ServerModel):
    def bench(argv: list[str], log_path: Path, timeout_s: float) -> BenchOutcome:
        model.calls.append(list(argv))
        c = int(flag(argv, "--max-concurrency"))
        n = int(flag(argv, "--num-requests"))
        out_tokens = int(flag(argv, "--output-len"))
        ctx = int(flag(argv, "--input-len"))
        rng = np.random.default_rng(int(flag(argv, "--seed", "0")))
        service = model.ttft_ms + (out_tokens - 1) * model.itl_ms
        records = []
        for i in range(n):
            wave = (i % c) // model.capacity
            ttft = model.ttft_ms + ctx * model.prefill_ms_per_token + wave * service + rng.uniform(0, 2)
            start = i * 0.001
            failed = model.fail_every and (i + 1) % model.fail_every == 0
            cadence = model.itl_ms * (1 + rng.uniform(-model.itl_spread, model.itl_spread))
            gaps = [cadence * (1 + rng.uniform(-0.05, 0.05)) for _ in range(out_tokens - 1)]
            if model.stall_every and (i + 1) % model.stall_every == 0 and gaps:
                gaps[len(gaps) // 2] += model.stall_ms
            chunks = [start + (ttft + sum(gaps[:k])) / 1000.0 for k in range(out_tokens)]
            if failed:
                kept = out_tokens // 2 if model.fail_after_tokens is None else model.fail_after_tokens
                chunks = chunks[: min(kept, out_tokens)]
            records.append(
                RequestRecord(
                    index=i,
                    scheduled_s=start,
                    dispatched_s=start,
                    slot_s=start,
                    sent_s=start,
                    first_token_s=chunks[0] if chunks else None,
                    end_s=(chunks[-1] if chunks else start + ttft / 1000.0) + (0.001 if failed else 0.0),
                    chunk_times_s=chunks,
                    chunk_tokens=[1] * len(chunks),
                    output_tokens=len(chunks),
                    status=FAILED if failed else OK,
                    error="stream cut" if failed else None,
                )
            )
        profile = {f.lstrip("-"): flag(argv, f) for f in PROFILE_FLAGS}
        profile.update(model.profile_override)
        write_results(Path(flag(argv, "--output-dir")), records, profile)
        return BenchOutcome(0, None)

    return bench
