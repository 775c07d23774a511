"""`tierguard serve --step-log FILE`: every engine step as one JSON line.

The first line describes the engine (`kind: header`): its EngineConfig, the model's
config, the KV layout and block size in bytes, which compute paths it has, the names of
the step fields. Every further line is one step, a list in that field order:

    started (monotonic s), duration (s), one-token rows, their keys, chunks,
    chunk tokens, chunk keys, sampled rows, sequences preempted

Timestamps are CLOCK_MONOTONIC, the clock the bench client stamps its records with, so
a step can be matched to the tokens a client saw. This is what `tierguard predict`
fits its step cost model on. The writer runs on the engine thread: one short line per
step, line-buffered (nothing is lost when the server is killed).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tierguard.engine.api import StepStats

STEP_FIELDS = ("started", "duration", "token_rows", "token_row_keys", "chunks", "chunk_tokens", "chunk_keys",
               "sampled", "preempted")


def engine_header(engine) -> dict:
    """What a simulator needs to rebuild this engine's decisions (an LLMEngine)."""
    from tierguard.model import fused_decode

    runner = engine.runner
    native = bool(getattr(runner, "native_decode", False))
    return {
        "kind": "header",
        "fields": list(STEP_FIELDS),
        "model_name": engine.model_name,
        "engine_config": dataclasses.asdict(engine.config),
        "model_config": dict(vars(engine.model_config)),
        "kv_layout": dataclasses.asdict(runner.kv_layout),
        "block_bytes": runner.kv_layout.block_bytes,
        "dtype": str(runner.dtype).removeprefix("torch.") if hasattr(runner, "dtype") else None,
        "native_decode": native,
        "fused_max_rows": fused_decode.MAX_BATCH if native else 0,
    }


class StepLog:
    def __init__(self, path: str | Path, engine) -> None:
        self._f = open(path, "w", buffering=1)  # noqa: SIM115 - closed by close()
        self._f.write(json.dumps(engine_header(engine), default=str) + "\n")

    def __call__(self, s: StepStats) -> None:
        sh = s.shape
        row = [round(s.started_at, 6), round(s.duration_s, 6), sh.token_rows, sh.token_row_keys, sh.chunks,
               sh.chunk_tokens, sh.chunk_keys, sh.sampled, s.num_preempted]
        self._f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._f.close()


def read_step_log(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, steps as dicts by field name); a torn last line is skipped."""
    header: dict = {}
    steps: list[dict] = []
    for line in Path(path).read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and item.get("kind") == "header":
            header = item
        elif isinstance(item, list):
            steps.append(dict(zip(header.get("fields", STEP_FIELDS), item, strict=False)))
    return header, steps
