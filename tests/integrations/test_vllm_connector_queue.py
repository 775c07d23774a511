"""The vLLM connector's worker side reports a failed device copy as load errors, and the
scheduler side's store queue drains as stores complete. Both sides in one process
(harness.py), real media, real threads, no vLLM.

- A copy from host RAM into vLLM's KV cache that fails (the transfer raises, as a CUDA
  error would) ends the request's load with those blocks in
  `get_block_ids_with_load_errors`: vLLM recomputes them instead of reading blocks that
  were never written.
- The store queue is a bound on blocks in flight, not a budget that is spent: many more
  blocks than it holds, stored one request after another, are all accepted, and it is
  empty again after each (copy out and write-behind alike).
"""

from __future__ import annotations

import pytest
import torch

from tests.integrations.harness import BLOCK, Engine, config, hashes_of
from tests.integrations.test_vllm_connector_logic import _disk, _write_prefix
from tierguard.integrations.vllm.worker import TierWorker


class FailingFirstCopy(TierWorker):
    """The worker side whose first device <-> host copy fails."""

    def _attach(self, ops) -> None:
        fresh = self.transfer is None
        super()._attach(ops)
        if fresh:
            self.transfer.faults.fail("transfer")


def test_a_failed_device_copy_is_reported_as_load_errors(tmp_path):
    cfg = _disk(tmp_path)
    hashes, written = _write_prefix(tmp_path, cfg)
    eng = Engine(cfg, worker_cls=FailingFirstCopy)
    try:
        before = eng.blocks(list(range(len(hashes))))
        targets, step = eng.load("r", hashes)  # staged from disk into host RAM, then copied in
        assert len(targets) == len(hashes)
        assert step.errors == set(targets)  # the copy failed: vLLM must recompute every block
        assert all(torch.equal(a, b) for a, b in zip(eng.blocks(targets), before, strict=True))
        assert eng.worker.transfer.faults.fired == {"transfer": 1}
        # the staged blocks were good: the next request's copy from host RAM succeeds
        targets2, step2 = eng.load("r2", hashes)
        assert step2.errors == set()
        assert all(torch.equal(a, b) for a, b in zip(eng.blocks(targets2), written, strict=True))
    finally:
        eng.close()


@pytest.mark.parametrize("with_disk", [False, True], ids=["host", "host+disk"])
def test_the_store_queue_drains_as_stores_complete(tmp_path, with_disk):
    queue, per_request, requests = 4, 3, 12  # 36 blocks through a queue of 4
    cfg = _disk(tmp_path, store_queue_blocks=queue) if with_disk else config(tmp_path, store_queue_blocks=queue)
    eng = Engine(cfg)
    try:
        blocks = eng.alloc(per_request)
        for i in range(requests):
            base = 10_000 * (i + 1)
            hashes = hashes_of(list(range(base, base + per_request * BLOCK)))
            assert eng.finish(f"r{i}", hashes, blocks) is True, f"store {i} dropped"
            eng.run_until(lambda s, r=f"r{i}": r in s[-1].sent)
            eng.run_until(lambda _: not eng.sched._jobs)  # write-behind, when there is a disk
            assert eng.sched.stats().store_queue_blocks == 0, i
        s = eng.sched.stats()
        assert s.dropped_stores == 0 and s.skipped_write_behind_blocks == 0
        assert s.tiers.offloaded_blocks == requests * per_request
        if with_disk:
            assert s.tiers.manager.persisted == requests * per_request
    finally:
        eng.close()
