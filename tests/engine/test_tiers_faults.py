"""Faults driven through the engine: each ends with correct greedy output and no crash.

Corrupted block files, a full disk (tiny budget, injected ENOSPC), a read-only directory
(injected EROFS: the tests run as root, where chmod does not stop writes), an unusable
directory, I/O errors in the transfer worker, a staging deadline missed (interactive
recomputes, batch waits), and kill -9 of a writer followed by a restart.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.engine.conftest import make_engine
from tests.engine.test_tiers import GREEDY, PROMPTS, run
from tierguard.kv.faults import FaultInjector


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return run(make_engine(tiny_dir), PROMPTS)


def tiers(path, **kw) -> dict:
    return dict(kv_host_gib=0.01, kv_disk_dir=str(path), kv_disk_gib=0.05, **kw)


def persist(tiny_dir, path, prompts) -> None:
    engine = make_engine(tiny_dir, **tiers(path))
    run(engine, prompts)
    engine.close()
    assert engine.stats().flat()["kv_persisted_blocks"] > 0


def block_files(path) -> list:
    return [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]


def test_corrupted_block_files_are_misses(tiny_dir, reference, tmp_path):
    persist(tiny_dir, tmp_path, PROMPTS[:2])
    files = block_files(tmp_path)
    assert files
    for f in files:  # flip payload bytes, keep the size
        data = bytearray(f.read_bytes())
        data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
        f.write_bytes(bytes(data))
    engine = make_engine(tiny_dir, **tiers(tmp_path))
    try:
        assert run(engine, PROMPTS[:2]) == reference[:2]
        x = engine.stats().flat()
        assert x["kv_disk_corrupt"] > 0 and x["kv_stage_failures"] > 0
    finally:
        engine.close()


def test_disk_full_tiny_budget_and_enospc(tiny_dir, reference, tmp_path):
    engine = make_engine(tiny_dir, kv_host_gib=0.01, kv_disk_dir=str(tmp_path / "tiny"), kv_disk_gib=1e-6)
    try:
        assert run(engine, PROMPTS[:2]) == reference[:2]
    finally:
        engine.close()
    assert engine.stats().flat()["kv_persisted_blocks"] == 0
    faults = FaultInjector()
    faults.fail("disk.write", errno.ENOSPC, times=100)
    engine = make_engine(tiny_dir, faults=faults, **tiers(tmp_path / "full"))
    try:
        assert run(engine, PROMPTS) == reference
        healthy, reason = engine.connector.health()["disk"]
        assert not healthy and "full" in reason
        assert engine.stats().flat()["kv_disk_healthy"] == 0.0
        assert run(engine, PROMPTS[:1]) == reference[:1]  # still serving
    finally:
        engine.close()


def test_read_only_and_unusable_directory(tiny_dir, reference, tmp_path):
    faults = FaultInjector()
    faults.fail("disk.write", errno.EROFS, times=100)
    engine = make_engine(tiny_dir, faults=faults, **tiers(tmp_path / "ro"))
    try:
        assert run(engine, PROMPTS[:2]) == reference[:2]
        assert not engine.connector.health()["disk"][0]
    finally:
        engine.close()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    engine = make_engine(tiny_dir, **tiers(not_a_dir))
    try:
        assert run(engine, PROMPTS[:2]) == reference[:2]
        healthy, reason = engine.connector.health()["disk"]
        assert not healthy and reason
    finally:
        engine.close()


def test_transfer_worker_io_errors(tiny_dir, reference, tmp_path):
    persist(tiny_dir, tmp_path, PROMPTS)
    faults = FaultInjector()
    faults.fail("transfer", errno.EIO, times=6)
    engine = make_engine(tiny_dir, num_blocks=48, faults=faults, **tiers(tmp_path))
    try:
        assert run(engine, PROMPTS) == reference
        assert faults.fired.get("transfer", 0) > 0
    finally:
        engine.close()


def _slow_disk_reads(seconds: float) -> FaultInjector:
    """The first disk block read waits `seconds` (an injected slow device)."""
    faults = FaultInjector()
    faults.delay("disk.read", seconds)
    return faults


def test_missed_staging_deadline_interactive_recomputes(tiny_dir, reference, tmp_path):
    persist(tiny_dir, tmp_path, PROMPTS[:1])
    faults = _slow_disk_reads(0.3)
    engine = make_engine(tiny_dir, faults=faults, **tiers(tmp_path, ttft_budget_ms={"interactive": 20.0}))
    try:
        assert run(engine, PROMPTS[:1]) == reference[:1]
        x = engine.stats().flat()
        assert x["kv_tier_recomputes"] == 1
        assert x["kv_staging_deadline_misses_interactive"] == 1
        assert x["kv_contract_interactive_recompute"] == 1
    finally:
        engine.close()


def test_missed_staging_deadline_batch_keeps_waiting(tiny_dir, reference, tmp_path):
    persist(tiny_dir, tmp_path, PROMPTS[:1])
    faults = _slow_disk_reads(0.3)
    engine = make_engine(tiny_dir, faults=faults, **tiers(tmp_path, ttft_budget_ms={"batch": 20.0}))
    try:
        engine.add_request("b", PROMPTS[0], GREEDY, request_class="batch")
        out = []
        while engine.has_unfinished():
            out.extend(t for o in engine.step() for t in o.new_token_ids)
            engine.check_integrity()
        assert out == reference[0]
        x = engine.stats().flat()
        assert x["kv_contract_batch_wait"] == 1 and x["kv_tier_recomputes"] == 0
        assert x["kv_blocks_loaded_from_disk"] > 0
    finally:
        engine.close()


def test_abort_while_loading_releases_blocks(tiny_dir, tmp_path):
    persist(tiny_dir, tmp_path, PROMPTS[:1])
    engine = make_engine(tiny_dir, faults=_slow_disk_reads(0.2), **tiers(tmp_path))
    try:
        engine.add_request("a", PROMPTS[0], GREEDY)
        engine.step()
        assert engine.stats().flat()["kv_loading_seqs"] == 1
        engine.abort("a")
        engine.check_integrity()
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
        assert engine.pool.num_used == 0
    finally:
        engine.close()


WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from conftest import make_engine, prompt_ids
    from pathlib import Path
    from tierguard.engine.api import SamplingParams
    e = make_engine(Path({model!r}), kv_host_gib=0.01, kv_disk_dir={disk!r}, kv_disk_gib=0.05)
    print("ready", flush=True)
    for i in range(1000):
        e.generate([prompt_ids(5000 + i, 64)], SamplingParams(max_tokens=4, temperature=0.0))
    """
)


def test_kill_9_during_writes_then_restart(tiny_dir, reference, tmp_path):
    persist(tiny_dir, tmp_path, PROMPTS[:1])
    code = WRITER.format(tests=os.path.dirname(__file__), model=str(tiny_dir), disk=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # writing blocks continuously by now
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    engine = make_engine(tiny_dir, **tiers(tmp_path))
    try:
        assert run(engine, PROMPTS[:2]) == reference[:2]
        assert engine.stats().flat()["kv_disk_hits"] > 0  # the earlier prefix survived
        assert not list(tmp_path.rglob("*.tmp*"))
    finally:
        engine.close()
