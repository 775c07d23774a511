"""A stand-in for `tierguard bench` for fast runner tests: writes a result directory
in the bench's documented shape, from a closed-form model of a server with a fixed
capacity (requests beyond it wait for a whole request's time)."""

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
            chunks = [start + (ttft + k * model.itl_ms) / 1000.0 for k in range(out_tokens)]
            records.append(
                RequestRecord(
                    index=i,
                    scheduled_s=start,
                    dispatched_s=start,
                    slot_s=start,
                    sent_s=start,
                    first_token_s=None if failed else chunks[0],
                    end_s=chunks[-1],
                    chunk_times_s=[] if failed else chunks,
                    chunk_tokens=[] if failed else [1] * out_tokens,
                    output_tokens=0 if failed else out_tokens,
                    status=FAILED if failed else OK,
                    error="boom" if failed else None,
                )
            )
        profile = {f.lstrip("-"): flag(argv, f) for f in PROFILE_FLAGS}
        profile.update(model.profile_override)
        write_results(Path(flag(argv, "--output-dir")), records, profile)
        return BenchOutcome(0, None)

    return bench
