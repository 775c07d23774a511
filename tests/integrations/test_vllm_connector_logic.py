"""The vLLM connector's policy without vLLM: both sides in one process (harness.py), real
media (disk files, a real redis-server), real threads, a fake KV cache in vLLM's CPU layout.

What must hold: blocks round-trip byte for byte (device -> host -> disk -> a new process's
index -> device); a load past its class deadline is given back with every block in error
and counted, batch waits longer; a corrupt or undecryptable block becomes load errors, the
good prefix before it still loads; a full store queue drops the store and counts it; one
load per request; bad options are refused with their name.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.integrations.harness import BLOCK, Engine, HeldFaults, PinnedClock, config, hashes_of
from tierguard.common.errors import TierguardError
from tierguard.integrations.vllm.config import parse_config
from tierguard.integrations.vllm.worker import TierWorker
from tierguard.kv.faults import FaultInjector

TOKENS = list(range(1000, 1000 + 6 * BLOCK))  # six full blocks


def _disk(tmp_path, **kw):
    return config(tmp_path, kv_disk_dir=str(tmp_path / "kv"), kv_disk_gib=0.01, **kw)


class HeldCopies(TierWorker):
    """The worker side, its device <-> host copies held until `held.release` is set."""

    def __init__(self, geometry, num_threads: int = 1) -> None:
        super().__init__(geometry, num_threads)
        self.held = HeldFaults("transfer")

    def _attach(self, ops) -> None:
        super()._attach(ops)
        self.transfer.faults = self.held


def _write_prefix(tmp_path, cfg) -> tuple[list[int], list[torch.Tensor]]:
    """A first engine computes six blocks, stores them, and shuts down (disk keeps them)."""
    eng = Engine(cfg)
    try:
        hashes = hashes_of(TOKENS)
        blocks = eng.alloc(len(hashes))
        eng.fill(blocks, seed=7)
        eng.store("writer", hashes, blocks)
        assert eng.sched.stats().tiers.manager.persisted == len(hashes)
        return hashes, eng.blocks(blocks)
    finally:
        eng.close()


def test_blocks_round_trip_through_disk_across_a_restart(tmp_path):
    cfg = _disk(tmp_path)
    hashes, written = _write_prefix(tmp_path, cfg)
    eng = Engine(cfg)  # a new engine: empty host RAM, the disk index rebuilt from files
    try:
        assert eng.sched.lookup("reader", hashes, 0) == len(hashes)
        assert eng.sched.lookup("reader", hashes, 2) == len(hashes) - 2
        targets, step = eng.load("reader", hashes)
        assert step.errors == set()
        assert all(torch.equal(a, b) for a, b in zip(eng.blocks(targets), written, strict=True))
        s = eng.sched.stats().tiers
        assert s.blocks_loaded_from["disk"] == len(hashes) and s.loads_done == 1
    finally:
        eng.close()


def test_a_stalled_disk_read_is_given_back_at_the_interactive_deadline(tmp_path):
    """At the class deadline on the scheduler side's clock, not some time later: the
    clock is pinned and the disk read held, so the step at the deadline still waits and
    the first step past it gives the request back."""
    cfg = _disk(tmp_path, load_deadline_ms={"interactive": 125, "batch": 5000})
    hashes, _ = _write_prefix(tmp_path, cfg)
    faults, clock = HeldFaults("disk.read"), PinnedClock()
    eng = Engine(cfg, faults, clock=clock)
    try:
        n = eng.sched.lookup("r", hashes, 0)
        targets = eng.alloc(n)
        eng.sched.begin_load("r", "interactive", hashes[:n], targets)
        assert faults.reached.wait(30)  # the read is in flight, and stays there
        clock.t += 0.125  # exactly the deadline: still waiting for the tier
        step = eng.step()
        assert "r" not in step.recved and step.errors == set()
        clock.t += 1e-6  # just past it: given back in this step, every block recomputed by vLLM
        step = eng.step()
        assert "r" in step.recved and step.errors == set(targets)
        s = eng.sched.stats().tiers
        assert s.recomputes == 1 and s.contract.deadline_misses == {"interactive": 1}
        assert s.contract.decisions == {"interactive_recompute": 1}
        assert s.load_p99_ms == pytest.approx(125.0, abs=0.01)  # the load lasted its deadline
        assert eng.sched.stats().load_error_blocks == len(targets)
        # One load per request: the recomputing request is not offered the tier again.
        assert eng.sched.lookup("r", hashes, 0) == 0
        # The abandoned read ends in the background; what it staged is kept in host RAM.
        faults.release.set()
        eng.run_until(lambda _: not eng.sched._jobs, timeout_s=10)
        assert eng.sched.host.stats().num_ready == len(hashes)
    finally:
        faults.release.set()
        eng.close()


def test_batch_waits_longer_than_interactive(tmp_path):
    cfg = _disk(tmp_path, load_deadline_ms={"interactive": 100, "batch": 5000})
    hashes, written = _write_prefix(tmp_path, cfg)
    faults, clock = HeldFaults("disk.read"), PinnedClock()
    eng = Engine(cfg, faults, clock=clock)
    try:
        n = eng.sched.lookup("b", hashes, 0)
        targets = eng.alloc(n)
        eng.sched.begin_load("b", "batch", hashes[:n], targets)
        assert faults.reached.wait(30)
        clock.t += 0.6  # past interactive's deadline, within batch's
        assert "b" not in eng.step().recved
        faults.release.set()
        step = eng.run_until(lambda s: "b" in s[-1].recved)[-1]
        assert step.errors == set()
        assert all(torch.equal(a, b) for a, b in zip(eng.blocks(targets), written, strict=True))
        assert eng.sched.stats().tiers.recomputes == 0
    finally:
        faults.release.set()
        eng.close()


def test_a_corrupt_block_is_recomputed_and_the_prefix_before_it_loads(tmp_path):
    cfg = _disk(tmp_path)
    hashes, written = _write_prefix(tmp_path, cfg)
    (victim,) = (tmp_path / "kv").rglob(f"{hashes[3]:064x}.kvb")
    data = bytearray(victim.read_bytes())
    data[200] ^= 0xFF  # a flipped payload byte: the checksum fails
    victim.write_bytes(bytes(data))
    eng = Engine(cfg)
    try:
        targets, step = eng.load("c", hashes)
        assert step.errors == set(targets[3:])  # the chain breaks at the corrupt block
        assert all(
            torch.equal(a, b) for a, b in zip(eng.blocks(targets[:3]), _per_block(written, 3), strict=True)
        )
        s = eng.sched.stats().tiers
        assert s.media["disk"].corrupt == 1 and s.contract.stage_failures == {"interactive": 1}
    finally:
        eng.close()


def _per_block(written: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """`written` is layer-major over six blocks; the first n blocks of each layer."""
    per_layer = len(written) // 2
    return [t for layer in range(2) for t in written[layer * per_layer : layer * per_layer + n]]


def test_a_block_sealed_with_another_key_is_recomputed(tmp_path):
    key_a, key_b = tmp_path / "a.key", tmp_path / "b.key"
    for k, byte in ((key_a, b"a"), (key_b, b"b")):
        k.write_bytes(byte * 32)
        k.chmod(0o600)
    hashes, _ = _write_prefix(tmp_path, _disk(tmp_path, kv_encrypt_key_file=str(key_a)))
    eng = Engine(_disk(tmp_path, kv_encrypt_key_file=str(key_b)))
    try:
        targets, step = eng.load("k", hashes)  # the index lists them; reading fails to authenticate
        assert len(targets) == len(hashes) and step.errors == set(targets)
        assert eng.sched.stats().tiers.media["disk"].undecodable >= 1
    finally:
        eng.close()


def test_a_full_store_queue_drops_the_store_and_never_waits(tmp_path):
    """A store that does not fit is dropped at once while the queue is full of copies
    that cannot end (the worker's copies held): `finish` returns before any of them does."""
    eng = Engine(config(tmp_path, store_queue_blocks=4), worker_cls=HeldCopies)
    try:
        hashes = hashes_of(TOKENS)
        blocks = eng.alloc(len(hashes))
        assert eng.finish("big", hashes, blocks) is False  # six blocks > a queue of four
        s = eng.sched.stats()
        assert s.dropped_stores == 1 and s.dropped_store_blocks == len(hashes)
        assert eng.finish("small", hashes[:3], blocks[:3]) is True  # fits: kept until copied
        eng.step()  # the worker starts the copy, which is held
        assert eng.worker.held.reached.wait(30)
        done: list[bool] = []
        t = threading.Thread(target=lambda: done.append(eng.finish("more", hashes[3:5], blocks[3:5])))
        t.start()
        t.join(30)  # a hang guard, not a bound
        assert done == [False] and eng.worker.transfer.queue_depth == 1  # dropped, the copy still held
        assert eng.sched.stats().dropped_store_blocks == len(hashes) + 2
        eng.worker.held.release.set()
        eng.run_until(lambda st: "small" in st[-1].sent)
        assert eng.sched.stats().tiers.offloaded_blocks == 3
    finally:
        eng.worker.held.release.set()
        eng.close()


def test_a_request_that_ends_while_loading_gets_its_blocks_back(tmp_path):
    cfg = _disk(tmp_path, load_deadline_ms=60000)
    hashes, _ = _write_prefix(tmp_path, cfg)
    faults = FaultInjector()
    faults.delay("disk.read", 1.0)
    eng = Engine(cfg, faults)
    try:
        n = eng.sched.lookup("gone", hashes, 0)
        targets = eng.alloc(n)
        eng.sched.begin_load("gone", "interactive", hashes[:n], targets)
        assert eng.finish("gone", hashes, targets) is False  # nothing of ours to store
        step = eng.run_until(lambda s: "gone" in s[-1].recved)[-1]
        assert step.errors == set(targets)
    finally:
        eng.close()


def test_redis_tier_shares_blocks_between_two_engines(tmp_path, redis_server):
    a = Engine(config(tmp_path / "a", kv_remote_url=redis_server.url))
    b = Engine(config(tmp_path / "b", kv_remote_url=redis_server.url))
    try:
        hashes = hashes_of(TOKENS)
        blocks = a.alloc(len(hashes))
        a.fill(blocks, seed=11)
        a.store("w", hashes, blocks)
        written = a.blocks(blocks)
        deadline = time.monotonic() + 10
        while b.sched.lookup("r", hashes, 0) < len(hashes):  # b learns from the journal
            assert time.monotonic() < deadline
            time.sleep(0.05)
        targets, step = b.load("r", hashes)
        assert step.errors == set()
        assert all(torch.equal(x, y) for x, y in zip(b.blocks(targets), written, strict=True))
        assert b.sched.stats().tiers.blocks_loaded_from["remote"] == len(hashes)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"kv_disk_dri": "/x"}, "unknown option(s) kv_disk_dri"),
        ({"kv_disk_dir": "/tmp/x"}, "kv_disk_dir needs a positive kv_disk_gib"),
        ({"kv_host_gib": 0}, "kv_host_gib must be positive"),
        ({"load_deadline_ms": "interactive=-1"}, "must be positive"),
        ({"load_deadline_ms": {"urgent": 5}}, "unknown request class 'urgent'"),
        ({"load_deadline_ms": {"interactive": 900, "batch": 100}}, "batch (100 ms) may not be shorter"),
        ({"kv_remote_url": "http://x"}, "kv_remote_url must be redis://"),
        ({"store_queue_blocks": 0}, "store_queue_blocks must be an integer >= 1"),
    ],
)
def test_bad_options_are_refused_by_name(options, needle):
    with pytest.raises(TierguardError) as e:
        parse_config(options)
    assert needle in str(e.value)


def test_deadlines_default_to_the_staging_share_of_the_ttft_budget():
    cfg = parse_config({"ttft_budget_ms": "interactive=800,batch=20000"})
    assert cfg.load_deadline_ms == {"interactive": 400.0, "batch": 10000.0}
    assert parse_config({"load_deadline_ms": 250}).load_deadline_ms["interactive"] == 250.0
