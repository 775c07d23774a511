"""`--kv-naive-sync-disk`: the benchmark's demand-paging scheduler (never for production).

The failure mode the cold contract exists to prevent, built as its own scheduling policy
so it can be measured side by side while the production scheduler and tiers carry no
trace of it. Admission is eager (FIFO, room for the first chunk only, no staging); when a
running sequence needs a block, the newest unscheduled one is *paged out* to disk
(naive_pager.py) instead of preempted, and a paged-out sequence is read back
synchronously inside the step where its turn comes, evicting what just ran, like demand
paging. The connector still copies finished sequences out (the same write-behind as the
contract variants), but a preemption (the fallback when paging fails) recomputes.
"""

from __future__ import annotations

import os
import shutil

from tierguard.baselines.naive_kv import NaiveSpillTier, NaiveSyncDisk
from tierguard.baselines.naive_pager import NaivePager
from tierguard.common.clock import SYSTEM_CLOCK, Clock
from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.engine.block_manager import BlockManager, PrefixMatch
from tierguard.engine.config import EngineConfig
from tierguard.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from tierguard.engine.sequence import Sequence, SequenceStatus
from tierguard.kv.connector import KVConnector
from tierguard.kv.spec import DevicePool


class NaivePagingScheduler(Scheduler):
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        connector: KVConnector,
        pager: NaivePager,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(config, block_manager, connector, clock=clock)
        self.pager = pager

    def stats(self) -> object:
        return self.pager.stats()

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)
        self.pager.forget(seq)

    def _stage(self, seq: Sequence, match: PrefixMatch) -> bool:
        return False  # the failure mode under test: eager admission, paging on the decode path

    def _release(self, seq: Sequence) -> None:
        self.pager.forget(seq)
        self.bm.free(seq)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        pager = self.pager
        scheduled_ids: set[str] = set()
        paged_now: set[str] = set()  # paged out in this step, not paged back in it
        order = sorted(self.running, key=lambda s: s.num_pending_tokens > 1)
        order.sort(key=lambda s: not pager.is_paged_out(s))  # what waited on disk runs first
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if pager.is_paged_out(seq):
                if seq.seq_id in paged_now or not self._page_in(seq, scheduled_ids, paged_now, out):
                    continue
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            while not self.bm.ensure_slots(seq, n):
                victim = self._newest_unscheduled(scheduled_ids, exclude=seq) or seq
                if pager.page_out(victim):
                    paged_now.add(victim.seq_id)
                    if victim is seq:
                        break  # it pages itself out and runs after a page-in in a later step
                    continue
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in paged_now:
                continue
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(seq.seq_id)
            budget -= n
        return budget

    def _page_in(
        self, seq: Sequence, scheduled_ids: set[str], paged_now: set[str], out: SchedulerOutput
    ) -> bool:
        """Read a paged-out sequence back inside this step, paging out the newest
        unscheduled ones to make room. False: it does not run this step."""
        while self.bm.pool.num_free < self.pager.blocks_needed(seq):
            victim = self._newest_unscheduled(scheduled_ids, exclude=seq)
            if victim is None or not self.pager.page_out(victim):
                return False
            paged_now.add(victim.seq_id)
        resident = self.pager.page_in(seq)
        if resident is False:  # a block was lost on disk: recompute from scratch
            self._preempt(seq)
            out.preempted.append(seq)
        return bool(resident)


def make_naive_scheduler(
    config: EngineConfig,
    bm: BlockManager,
    connector: KVConnector,
    device_pool: DevicePool,
    fingerprint: str,
    disk: NaiveSyncDisk | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> NaivePagingScheduler:
    """The paging scheduler over its own spill tier in `<kv_disk_dir>/naive-spill/`, or
    over `disk` when given (the simulator's, whose reads take simulated time)."""
    if not config.kv_disk_dir:
        raise TierguardError("--kv-naive-sync-disk needs a disk tier (--kv-disk-dir and --kv-disk-gib)")
    if disk is None:
        root = os.path.join(config.kv_disk_dir, "naive-spill")
        scratch = os.path.join(root, fingerprint)
        if os.path.isdir(scratch) and not os.path.islink(scratch):
            shutil.rmtree(scratch)  # spilled blocks of an earlier run are scratch, never reused
        disk = NaiveSyncDisk(device_pool, NaiveSpillTier(root, fingerprint, int(config.kv_disk_gib * GIB)))
    pager = NaivePager(bm.pool, disk, config.block_size)
    return NaivePagingScheduler(config, bm, connector, pager, clock)
