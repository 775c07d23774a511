"""The output directory of a run, and reading it back (`load_run`).

    requests.jsonl   one line per request (all phases; `phase` says which were measured)
    summary.json     flat vLLM-compatible keys plus tierguard's
    run.json         config, profile fingerprint, environment, quirks, self-check
    timeseries.json  per-second throughput, in-flight and sliding-window p99s
    metrics.jsonl    the server's /metrics, one scrape per line (when it has them)

Files are written to a temporary name and renamed, so a crash never leaves half a JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from tierguard.bench.records import RequestRecord
from tierguard.common.errors import TierguardError


def _clean(obj):
    """JSON has no inf/nan: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(path: Path, obj) -> None:
    _write(path, json.dumps(_clean(obj), indent=2, sort_keys=False) + "\n")


def write_run(out_dir: str | Path, summary: dict | None, run_info: dict, records: list[RequestRecord] | None = None,
              timeseries: list[dict] | None = None, metrics: list[dict] | None = None) -> Path:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    if records is not None:
        _write(d / "requests.jsonl", "".join(json.dumps(_clean(r.to_json())) + "\n" for r in records))
    if summary is not None:
        write_json(d / "summary.json", summary)
    write_json(d / "run.json", run_info)
    if timeseries is not None:
        write_json(d / "timeseries.json", timeseries)
    if metrics:
        _write(d / "metrics.jsonl", "".join(json.dumps(_clean(m)) + "\n" for m in metrics))
    return d


@dataclass
class LoadedRun:
    summary: dict
    run: dict
    records: list[RequestRecord] = field(default_factory=list)
    timeseries: list[dict] = field(default_factory=list)

    @property
    def fingerprint(self) -> str | None:
        return self.run.get("profile_fingerprint")


def load_run(out_dir: str | Path) -> LoadedRun:
    d = Path(out_dir)
    if not (d / "summary.json").is_file() or not (d / "run.json").is_file():
        raise TierguardError(f"{d}: not a tierguard bench output directory (summary.json/run.json missing)")
    try:
        summary = json.loads((d / "summary.json").read_text())
        run = json.loads((d / "run.json").read_text())
        recs = []
        if (d / "requests.jsonl").is_file():
            recs = [RequestRecord.from_json(json.loads(line))
                    for line in (d / "requests.jsonl").read_text().splitlines() if line.strip()]
        ts = json.loads((d / "timeseries.json").read_text()) if (d / "timeseries.json").is_file() else []
    except (ValueError, TypeError) as exc:
        raise TierguardError(f"{d}: unreadable bench results: {exc}") from None
    return LoadedRun(summary, run, recs, ts)
