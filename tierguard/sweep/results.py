"""Read a `tierguard bench` result directory (requests.jsonl, summary.json, run.json).

Only this module knows the bench's file layout, so a change there is a change here.
Per-request samples come from requests.jsonl; when it is missing (a result produced by
another tool) the cell falls back to summary.json's p99s without an interval.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tierguard.sweep.stats import RequestSample


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def sample_from_record(rec: dict) -> RequestSample:
    """One requests.jsonl line -> sample, with the bench's own timing definitions.

    Failed, timed-out, rejected and cancelled requests all become misses (ok=False).
    """
    from tierguard.bench.records import RequestRecord

    r = RequestRecord.from_json(rec)
    if not r.ok or r.ttft_ms is None:
        return RequestSample(ok=False)
    itl = r.itl_samples_ms()
    e2el = r.e2el_ms if r.e2el_ms is not None else math.inf
    tpot = r.tpot_ms if r.tpot_ms is not None else math.nan
    stall = r.stall_ms if r.stall_ms is not None else 0.0
    return RequestSample(
        ok=True, ttft_ms=r.ttft_ms, itl_ms=itl.tolist(), tpot_ms=tpot, e2el_ms=e2el, max_stall_ms=stall
    )


def load_samples(result_dir: Path) -> list[RequestSample]:
    """Per-request samples of one bench run; warm-up requests are excluded."""
    path = result_dir / "requests.jsonl"
    if path.is_file():
        out = []
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of an interrupted run
            if isinstance(rec, dict) and rec.get("phase", "measure") == "measure":
                out.append(sample_from_record(rec))
        return out
    return _samples_from_summary(result_dir)


def _samples_from_summary(result_dir: Path) -> list[RequestSample]:
    """Without requests.jsonl: synthesise samples that reproduce summary.json's p99s.

    Used only for foreign results; such cells carry no bootstrap interval worth the name.
    """
    s = read_json(result_dir / "summary.json")
    if not s:
        return []
    completed = int(s.get("completed", 0))
    failed = int(s.get("failed", 0)) + int(s.get("rejected", 0))
    if completed <= 0:
        return [RequestSample(ok=False) for _ in range(max(failed, 1))]
    p99 = {m: float(s.get(f"p99_{m}_ms") or 0.0) for m in ("ttft", "itl", "tpot", "e2el")}
    stall = float(s.get("max_stall_ms") or p99["itl"])
    good = [
        RequestSample(
            ok=True,
            ttft_ms=p99["ttft"],
            itl_ms=[p99["itl"]],
            tpot_ms=p99["tpot"],
            e2el_ms=p99["e2el"],
            max_stall_ms=stall,
        )
        for _ in range(completed)
    ]
    return good + [RequestSample(ok=False) for _ in range(failed)]
