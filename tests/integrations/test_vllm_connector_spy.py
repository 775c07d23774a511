"""No tier read runs on vLLM's forward thread: proven by a spy on every cold medium's read.

The harness (harness.py) calls every connector hook, scheduler and worker side, from the
test's thread, as vLLM's engine core does when both roles share a thread; that thread
plays the forward thread. The spy wraps `read_many` of the disk and Redis media and
records the thread of each call. The check must pass for `TierScheduler` (reads happen,
all on the connector's transfer threads) and must fail for a connector that reads its
tier synchronously at admission, the way ExampleConnector reads inside `start_load_kv`.
"""

from __future__ import annotations

import threading

import pytest

from tests.integrations.harness import Engine, config
from tests.integrations.test_vllm_connector_logic import _write_prefix
from tierguard.integrations.vllm.ops import LoadOp
from tierguard.integrations.vllm.scheduler import TierScheduler
from tierguard.integrations.vllm.worker import TierWorker
from tierguard.kv.guard import ColdContractViolation
from tierguard.kv.media.disk.tier import DiskTier
from tierguard.kv.media.remote.tier import RemoteTier


class ReadSpy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[int] = []
        for cls in (DiskTier, RemoteTier):
            original = cls.read_many

            def spied(medium, items, *a, _original=original, **kw):
                self.threads.append(threading.get_ident())
                return _original(medium, items, *a, **kw)

            monkeypatch.setattr(cls, "read_many", spied)


class SyncReadingScheduler(TierScheduler):
    """Stages the cold blocks itself, on the calling thread, before admitting the load
    (a synchronous connector); everything else is the real scheduler side."""

    def begin_load(self, req_id, request_class, hashes, targets):
        for medium in self.media.values():
            medium.read_many([(h, bytearray(self.block_bytes)) for h in hashes if medium.contains(h)])
        super().begin_load(req_id, request_class, hashes, targets)


def reads_on_forward_thread(tmp_path, monkeypatch, scheduler_cls) -> tuple[int, int]:
    """(medium reads on the forward thread, medium reads anywhere) for one restart + load."""
    cfg = config(tmp_path, kv_disk_dir=str(tmp_path / "kv"), kv_disk_gib=0.01)
    hashes, _ = _write_prefix(tmp_path, cfg)
    spy = ReadSpy(monkeypatch)
    forward = threading.get_ident()
    eng = Engine(cfg, scheduler_cls=scheduler_cls)
    try:
        targets, step = eng.load("r", hashes)
        assert step.errors == set() and len(targets) == len(hashes)
    finally:
        eng.close()
    return sum(1 for t in spy.threads if t == forward), len(spy.threads)


def check_no_read_on_forward_thread(tmp_path, monkeypatch, scheduler_cls) -> None:
    on_forward, total = reads_on_forward_thread(tmp_path, monkeypatch, scheduler_cls)
    assert total > 0, "the spy saw no read: the load did not touch the tier"
    assert on_forward == 0, f"{on_forward} of {total} tier reads ran on the forward thread"


def test_no_medium_read_runs_on_the_forward_thread(tmp_path, monkeypatch):
    check_no_read_on_forward_thread(tmp_path, monkeypatch, TierScheduler)


def test_the_spy_fails_a_connector_that_reads_synchronously(tmp_path, monkeypatch):
    with pytest.raises(AssertionError, match="ran on the forward thread"):
        check_no_read_on_forward_thread(tmp_path, monkeypatch, SyncReadingScheduler)


def test_a_tier_read_from_a_worker_hook_raises(tmp_path):
    """The enforcement half: the worker's hooks run under the decode guard, so a tier read
    reached from one (as ExampleConnector reads in start_load_kv) raises
    ColdContractViolation, counted by the medium, instead of stalling the forward pass."""
    cfg = config(tmp_path, kv_disk_dir=str(tmp_path / "kv"), kv_disk_gib=0.01)
    hashes, _ = _write_prefix(tmp_path, cfg)
    eng = Engine(cfg)
    disk = eng.sched.media["disk"]

    class ReadingWorker(TierWorker):
        def _attach(self, ops):
            disk.read_many([(hashes[0], bytearray(eng.sched.block_bytes))])
            super()._attach(ops)

    worker = ReadingWorker(eng.worker.geometry)
    worker.register(eng.kv)
    ops = eng.sched.build_ops()
    ops.loads.append(LoadOp("x", [0], [0]))
    try:
        with pytest.raises(ColdContractViolation):
            worker.start(ops)
        assert disk.stats().reads_in_decode == 1
    finally:
        worker.close()
        eng.close()
