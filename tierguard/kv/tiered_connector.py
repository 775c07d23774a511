"""`TieredConnector`: the KV connector over host RAM and the configured cold media.

Implements the hooks of connector.py. Every call comes from the engine thread and none
waits on a transfer: copies run on the transfer worker, and their completions are
handled in `poll()`.

One `_Load` record per load, from `start_load` until `poll()` hands the sequence back
(or, when the load was abandoned, until its copy ends):

    start_load -> [cold -> host jobs, one per medium] -> host -> device job -> publish
                  in the device prefix cache -> poll() returns the sequence

Device blocks this object holds references on (for the engine's integrity check): the
device hits and target blocks of every live load, the targets of abandoned loads until
their copy ends, and the source blocks of in-flight offloads (`_pins`).

A pool split into layer groups moves each group's blocks under its own key
(group_plan.py): a sliding group sends out and loads back its window only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierguard.common.clock import SYSTEM_CLOCK, Clock
from tierguard.common.stats import quantile_ms
from tierguard.kv.connector import (
    ConnectedSeq,
    DeviceBlockPool,
    KVConnector,
    Match,
    PollResult,
    TierOptions,
    TierStats,
)
from tierguard.kv.contract import BATCH, ColdContract
from tierguard.kv.copy_handlers import register_cold_medium, register_device_host
from tierguard.kv.faults import FaultInjector
from tierguard.kv.group_plan import load_keys, match_keys, offload_pairs
from tierguard.kv.groups import KVGroups
from tierguard.kv.manager import HOST, KVManager, LoadPlan, PersistPlan, StorePlan, TieredManager
from tierguard.kv.media import ColdMedium, DeviceBlocks, HostSlots, MediumContext, create_medium
from tierguard.kv.media.host import HostTier
from tierguard.kv.spec import DevicePool
from tierguard.kv.store_policy import OFFLOAD, PERSIST, StorePolicy
from tierguard.kv.transfer import TransferResult, TransferSpec, TransferWorker


@dataclass
class _Load:
    """One load, from start_load until its sequence is handed back or its copy ends."""

    seq: ConnectedSeq
    held: list[int]  # device cache hits at the head of the sequence, all groups (references held)
    targets: list[int]  # device blocks being filled, in order (references held)
    positions: list[int]  # the block position in the sequence of each target
    plan: LoadPlan  # the manager's pinned blocks, in the same order as `targets`
    started: float
    deadline: float
    pending_stages: int = 0  # cold -> host jobs still running
    stage_ok: dict[int, bool] = field(default_factory=dict)
    keep: int = 0  # leading blocks still loadable after staging
    decided: bool = False  # the contract already chose to keep waiting past the deadline
    abandoned: bool = False  # the sequence recomputes (or is gone); only the copy is left


class TieredConnector(KVConnector):
    def __init__(
        self,
        pool: DeviceBlockPool,
        device_pool: DevicePool,
        block_size: int,
        manager: KVManager,
        host: HostTier,
        media: list[ColdMedium],
        worker: TransferWorker,
        contract: ColdContract,
        groups: KVGroups | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.pool = pool
        self.clock = clock  # staging deadlines and load times: the engine's clock
        self.block_size = block_size
        self.groups = groups
        self.manager = manager
        self.host = host
        self.media = {m.name: m for m in media}  # read-only: tests and /health use it
        self.worker = worker
        self.store_policy: StorePolicy = worker.store_policy
        self.contract = contract
        self._loads: dict[str, _Load] = {}
        self._checked: set[str] = set()  # sequences whose tiers were consulted this stage
        self._pins: Counter[int] = Counter()  # in-flight offloads, abandoned loads' targets
        self._jobs: dict[int, Callable[[TransferResult], None]] = {}
        self._next_job = 0
        self._ready: list[Any] = []
        self._released: list[int] = []
        self._c = TierStats(blocks_loaded_from={m.name: 0 for m in media})
        self._load_seconds: list[float] = []
        self._stats_cache: TierStats | None = None
        self._stats_at = 0.0
        self._stats_key: tuple = ()
        self._jobs_done = 0

    @classmethod
    def create(
        cls,
        pool: DeviceBlockPool,
        device_pool: DevicePool,
        block_size: int,
        fingerprint: str,
        options: TierOptions,
        contract: ColdContract,
        faults: FaultInjector | None = None,
        groups: KVGroups | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> TieredConnector:
        """Host RAM, the configured cold media (by registered name), one transfer worker."""
        faults = faults or FaultInjector()
        host = HostTier(options.host_bytes, device_pool.block_bytes)
        ctx = MediumContext(fingerprint, device_pool.block_bytes, faults, options.codec)
        media = [create_medium(name, ctx, opts) for name, opts in options.media.items()]
        stores = StorePolicy(max_pending=options.store_max_pending, share=options.store_share, clock=clock.monotonic)
        worker = TransferWorker(device_pool.block_bytes, options.num_threads, faults, stores)
        register_device_host(worker, device_pool, host)
        for medium in media:
            register_cold_medium(worker, host, medium)
        manager = TieredManager(host, media)
        return cls(pool, device_pool, block_size, manager, host, media, worker, contract, groups, clock)

    # ---- admission: staging from host RAM and cold media ----

    def _load_keys(self, match: Match) -> tuple[int, list[int], list[int]]:
        """(extra blocks, keys to load, their block positions)."""
        if self.groups is None or not self.groups.hybrid:
            n = self.manager.lookup(match.missed_hashes)
            first = len(match.block_ids)
            return n, match.missed_hashes[:n], list(range(first, first + n))
        return load_keys(self.groups, self.manager.lookup, match, self.block_size)

    def _device_blocks(self, match: Match) -> list[int]:
        return match.device_blocks() if self.groups is not None and self.groups.hybrid else list(match.block_ids)

    def get_num_matched(self, seq: ConnectedSeq, match: Match) -> tuple[int, bool]:
        hybrid = self.groups is not None and self.groups.hybrid
        self.manager.touch(match_keys(self.groups, match) if hybrid else match.hashes)
        if seq.seq_id in self._checked or not match.missed_hashes:
            return 0, False
        self._checked.add(seq.seq_id)  # one staging attempt per stage of work
        n = self._load_keys(match)[0]
        return n * self.block_size, n > 0

    def start_load(self, seq: ConnectedSeq, match: Match) -> bool:
        avail, keys, positions = self._load_keys(match)
        if avail == 0:
            return False
        held = self._device_blocks(match)
        # Hold the device hits first: allocating targets may otherwise evict them.
        for b in held:
            self.pool.acquire(b)
        targets = [self.pool.allocate() for _ in keys]
        plan = self.manager.prepare_load(keys)
        n = len(plan.blocks)  # 0 when every host slot is pinned right now
        for b in targets[n:]:
            self.pool.release(b)
        if n == 0:
            for b in held:
                self.pool.release(b)
            return False
        now = self.clock.monotonic()
        # The stage starts now (admission or restore), not at arrival: a request that queued
        # for room must not lose its staging window to the queueing.
        deadline = self.contract.staging_deadline(self.contract.class_of(seq.request_class), now)
        load = _Load(seq, held, targets[:n], positions[:n], plan, now, deadline)
        self._loads[seq.seq_id] = load
        staged = plan.staged()
        load.pending_stages = len(staged)
        for name, blocks in staged.items():
            medium = self.media[name]
            spec = TransferSpec(
                medium.spec([b.block_hash for b in blocks]), HostSlots([b.host_slot for b in blocks])
            )
            self._submit(spec, lambda r, load=load, blocks=blocks: self._on_staged(load, blocks, r))
        if not staged:
            load.keep = n
            self._load_to_device(load)
        self._c.loads_started += 1
        return True

    def _on_staged(self, load: _Load, blocks: list, result: TransferResult) -> None:
        load.stage_ok.update(zip((b.block_hash for b in blocks), result.block_ok, strict=True))
        load.pending_stages -= 1
        if load.pending_stages:
            return
        load.keep = self.manager.complete_stage(load.plan, load.stage_ok)
        if not load.abandoned and load.keep < len(load.plan.blocks):
            failed = sorted({b.source for b in load.plan.blocks if not load.stage_ok.get(b.block_hash, True)})
            self.contract.decide_on_failure(
                self.contract.class_of(load.seq.request_class), f"blocks from {', '.join(failed)} did not arrive"
            )
        if load.keep and not load.abandoned:
            self._load_to_device(load)
            return
        self.manager.complete_load(load.plan, load.keep)
        self._finish(load, 0)

    def _load_to_device(self, load: _Load) -> None:
        blocks = load.plan.blocks[: load.keep]
        spec = TransferSpec(HostSlots([b.host_slot for b in blocks]), DeviceBlocks(load.targets[: load.keep]))
        self._submit(spec, lambda r: self._on_loaded(load, r))

    def _on_loaded(self, load: _Load, result: TransferResult) -> None:
        self.manager.complete_load(load.plan, load.keep)
        self._finish(load, load.keep if result.success else 0)

    def _finish(self, load: _Load, num_blocks: int) -> None:
        if load.abandoned:
            for b in load.targets:
                self._unpin(b)
            return
        self._loads.pop(load.seq.seq_id, None)
        seq, bs = load.seq, self.block_size
        # Publish what arrived under its key: re-admission finds it as a device hit.
        for i in range(num_blocks):
            j = load.positions[i]
            self.pool.register(
                load.targets[i], load.plan.blocks[i].block_hash, tuple(seq.token_ids[j * bs : (j + 1) * bs])
            )
        for b in load.held + load.targets:
            self.pool.release(b)
        c = self._c
        c.loads_done += 1
        c.blocks_loaded += num_blocks
        for b in load.plan.blocks[:num_blocks]:
            if b.source != HOST:
                c.blocks_loaded_from[b.source] += 1
        self._load_seconds.append(self.clock.monotonic() - load.started)
        del self._load_seconds[:-512]
        self._ready.append(seq)

    def _on_deadline(self, load: _Load) -> None:
        decision = self.contract.decide_on_miss(
            self.contract.class_of(load.seq.request_class), staged_in_time=False
        )
        if decision.action == "wait":
            load.decided = True
        elif decision.action == "async":
            load.seq.request_class = BATCH
            load.decided = True
            self._c.async_handoffs += 1
        else:
            self._c.recomputes += 1
            self._drop(load)
            self._ready.append(load.seq)

    def _drop(self, load: _Load) -> None:
        """Abandon a load: its hits are released now, its targets when its copy ends."""
        self._loads.pop(load.seq.seq_id, None)
        load.abandoned = True
        self._pins.update(load.targets)  # the targets' references become pins
        for b in load.held:
            self.pool.release(b)

    def abort(self, seq: ConnectedSeq) -> None:
        self._checked.discard(seq.seq_id)
        load = self._loads.get(seq.seq_id)
        if load is not None:
            self._drop(load)

    # ---- sequences leaving the device ----

    def offload(self, seq: ConnectedSeq, preempted: bool) -> None:
        if preempted:
            self._checked.discard(seq.seq_id)  # its re-admission is a new stage: restore from host
        if self.groups is not None and self.groups.hybrid:
            hashes, blocks = offload_pairs(self.groups, seq)
        else:
            n = min(len(seq.block_hashes), len(seq.block_table))
            hashes, blocks = list(seq.block_hashes[:n]), seq.block_table[:n]
        n = len(hashes)
        if n == 0:
            return
        persist = not preempted and bool(self.media)
        if persist:  # already in host RAM: only the write-behind is left to do
            self._persist([h for h in hashes if self.host.contains(h)])
        # A preempted sequence's swap-out is a promotion (it will be restored); a finished
        # one's blocks are a store, admitted under backpressure (store_policy.py).
        store = not preempted
        wanted = any(not self.host.is_present(h) for h in hashes)
        if wanted and store and not self.store_policy.admit(OFFLOAD):
            wanted = False
        plan = self.manager.prepare_store(hashes) if wanted else StorePlan(to_store=[])
        in_flight: list[int] = []
        if plan.to_store:
            by_hash = dict(zip(hashes, blocks, strict=True))
            in_flight = [by_hash[h] for h, _ in plan.to_store]
            for b in in_flight:
                self.pool.acquire(b)
                self._pins[b] += 1
            spec = TransferSpec(DeviceBlocks(in_flight), HostSlots([slot for _, slot in plan.to_store]))
            self._submit(spec, lambda r: self._on_stored(plan, in_flight, persist, store, r), store=store,
                         holds_device=True)
        elif wanted and store:
            self.store_policy.done(OFFLOAD, 0.0)
        if preempted:
            present = sum(1 for h in hashes if self.host.is_present(h))
            self._c.swap_out_blocks += present
            self._c.swap_recompute_blocks += n - present
        else:
            self._c.offloaded_blocks += len(in_flight)

    def _on_stored(
        self, plan: StorePlan, device_blocks: list[int], persist: bool, store: bool, result: TransferResult
    ) -> None:
        if store:
            self.store_policy.done(OFFLOAD, result.seconds)
        self.manager.complete_store(plan, result.success)
        for b in device_blocks:
            self._unpin(b)
        if result.success and persist:
            self._persist([h for h, _ in plan.to_store])

    def _persist(self, hashes: list[int]) -> None:
        """Write host blocks behind to the cold media: one store, admitted or dropped."""
        writable = [m for m in self.media.values() if m.writes_enabled]
        if not any(not m.contains(h) for m in writable for h in hashes):
            return
        if not self.store_policy.admit(PERSIST):
            return
        plans = self.manager.prepare_persist(hashes)
        if not plans:
            self.store_policy.done(PERSIST, 0.0)
            return
        left = [len(plans)]

        def on_done(p: PersistPlan, r: TransferResult) -> None:
            self.manager.complete_persist(p, r.block_ok)
            left[0] -= 1
            if left[0] == 0:
                self.store_policy.done(PERSIST, r.seconds)

        for p in plans:
            medium = self.media[p.medium]
            spec = TransferSpec(HostSlots([s for _, s in p.blocks]), medium.spec([h for h, _ in p.blocks]))
            self._submit(spec, lambda r, p=p: on_done(p, r), store=True)

    # ---- progress ----

    def _submit(self, spec: TransferSpec, on_done: Callable[[TransferResult], None], store: bool = False,
                holds_device: bool = False) -> None:
        self._next_job += 1
        self._jobs[self._next_job] = on_done
        self.worker.transfer_async(self._next_job, spec, store=store, holds_device=holds_device)

    def poll(self) -> PollResult:
        for done in self.worker.get_finished():
            self._jobs_done += 1
            self._jobs.pop(done.job_id)(done)
        for block_hash in self.pool.take_evicted():
            # Copies were made when the block's sequence ended (an async copy at eviction
            # would have to delay the reuse), so this only counts prefix blocks lost for
            # good: a sign the host tier is too small.
            if not self.host.contains(block_hash) and not any(
                m.contains(block_hash) for m in self.media.values()
            ):
                self._c.device_evictions_uncopied += 1
        now = self.clock.monotonic()
        for load in list(self._loads.values()):
            if not load.decided and now > load.deadline:
                self._on_deadline(load)
        out = PollResult(self._ready, self._released)
        self._ready, self._released = [], []
        return out

    def _unpin(self, block_id: int) -> None:
        if self._pins[block_id] <= 0:
            return
        self._pins[block_id] -= 1
        if self._pins[block_id] == 0:
            del self._pins[block_id]
        self.pool.release(block_id)
        self._released.append(block_id)

    # ---- engine-facing queries ----

    def busy(self) -> bool:
        # Jobs submitted and not yet seen by poll(): a finished store still has to be
        # polled to submit its write-behind.
        return bool(self._loads or self._pins or self._jobs or self.worker.queue_depth)

    def held_refs(self) -> Counter[int]:
        refs: Counter[int] = Counter(self._pins)
        for load in self._loads.values():
            refs.update(load.held)
            refs.update(load.targets)
        return refs

    def health(self) -> dict[str, tuple[bool, str]]:
        return {name: (bool(m.healthy), str(m.reason)) for name, m in self.media.items()}

    def stats(self, max_age_s: float = 0.0) -> TierStats:
        """The async engine asks after every step and the percentiles sort latency windows,
        so it accepts values up to `max_age_s` old; fresh after any tier event (a job
        submitted or finished, a load started, a decision, an eviction counted), so that a
        step without one (most decode steps) does not pay for a recount."""
        now = self.clock.monotonic()
        c = self._c
        key = (self._next_job, self._jobs_done, c.loads_started, c.recomputes, c.async_handoffs,
               c.swap_out_blocks, c.swap_recompute_blocks, c.device_evictions_uncopied)  # fmt: skip
        if self._stats_cache is None or now - self._stats_at >= max_age_s or key != self._stats_key:
            self._stats_cache, self._stats_at, self._stats_key = self._compute_stats(), now, key
        return self._stats_cache

    def _compute_stats(self) -> TierStats:
        c = self._c
        return TierStats(
            loads_started=c.loads_started,
            loads_done=c.loads_done,
            blocks_loaded=c.blocks_loaded,
            blocks_loaded_from=dict(c.blocks_loaded_from),
            recomputes=c.recomputes,
            async_handoffs=c.async_handoffs,
            swap_out_blocks=c.swap_out_blocks,
            swap_recompute_blocks=c.swap_recompute_blocks,
            offloaded_blocks=c.offloaded_blocks,
            device_evictions_uncopied=c.device_evictions_uncopied,
            loading_seqs=len(self._loads),
            pinned_blocks=sum(self._pins.values()),
            load_p99_ms=quantile_ms(list(self._load_seconds), 0.99),
            transfer_queue_depth=self.worker.queue_depth,
            manager=self.manager.stats(),
            stores=self.store_policy.stats(),
            host=self.host.stats(),
            media={name: m.stats() for name, m in self.media.items()},
            routes=self.worker.route_stats(),
            contract=self.contract.stats(),
            latency=self.worker.latency_histograms(),
        )

    def close(self, timeout_s: float = 10.0) -> None:
        end = self.clock.monotonic() + timeout_s
        for load in list(self._loads.values()):
            self._drop(load)
        while self.clock.monotonic() < end and (self._pins or self._jobs):
            self.poll()
            self.clock.sleep(0.005)
        self.worker.shutdown()
        for m in self.media.values():
            m.close()
