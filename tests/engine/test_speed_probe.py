"""`python -m tierguard.engine.speed` measures the batch it names: every sequence decodes
in the timed steps (the serve step budget once kept later prefills queued, so a "batch
32" on SmolLM2 timed about 4 running sequences)."""

from __future__ import annotations

import json
import subprocess
import sys


def _probe(model_dir, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tierguard.engine.speed", "--model", str(model_dir), "--no-profile",
           "--threads", "1", "--prompt-len", "48", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_every_sequence_of_the_batch_decodes(tiny_dir):
    proc = _probe(tiny_dir, "--batch", "12", "--steps", "6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["batch"] == 12
    assert result["tokens"] == 12 * 6  # one token per sequence per timed step


def test_a_pool_too_small_for_the_batch_is_one_line_and_exit_2(tiny_dir):
    proc = _probe(tiny_dir, "--batch", "12", "--steps", "6", "--kv-cache-gib", "0.0002")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "fit the KV pool" in proc.stderr and "Traceback" not in proc.stderr
