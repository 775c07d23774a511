"""The scheduler side of the vLLM connector: the tiers, the index, the deadlines, the stores.

It owns what our engine's `TieredConnector` owns: the host tier's bookkeeping
(`HostTier`, its slab shared with the worker, shm.py), the cold media (disk, Redis: the
same `ColdMedium`s, block format, codec and index), the `TieredManager` and a
`TransferWorker` whose threads do every cold read and write. vLLM calls it from the
engine-core thread; no call waits on a tier:

    lookup        index only (host RAM, the disk index, the Redis index): no I/O
    begin_load    pin host blocks, reserve slots for cold ones, submit cold -> host jobs
    build_ops     (every step) poll jobs; hand staged loads to the worker; abandon loads
                  past their class deadline; hand out queued stores
    finish        a request ended: queue the copy of its full blocks to host RAM, or drop
                  it when the store queue is full
    on_output     the worker finished loads and stores: unpin; write stored blocks behind
                  to the cold media

A load's deadline starts when vLLM allocates its blocks and is its class's
`load_deadline_ms`. Past it, the load is abandoned: the worker reports the request done
with all its blocks in error, vLLM recomputes them, and the cold jobs end in the
background (what they staged stays in host RAM for the next request). A staged block
that fails (absent, corrupt, undecryptable, medium down) is reported the same way at
once. Each request gets one load: a failed or abandoned one is never retried, so a
broken tier cannot loop a request (vLLM #49176).

Every call runs under `decode_guard()`: a medium read reached from here raises
`ColdContractViolation` (tierguard/kv/guard.py) instead of stalling the step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tierguard.integrations.vllm.shm as shm
from tierguard.common.histogram import LatencyHistogram
from tierguard.common.stats import quantile_ms
from tierguard.integrations.vllm.config import ConnectorConfig
from tierguard.integrations.vllm.faults import FaultFileWatcher
from tierguard.integrations.vllm.ops import LoadOp, StepOps, StoreOp, WorkerReport
from tierguard.integrations.vllm.stats import LOAD_BUCKETS, ConnectorStats
from tierguard.kv.connector import TierStats
from tierguard.kv.contract import ColdContract
from tierguard.kv.copy_handlers import register_cold_medium
from tierguard.kv.faults import FaultInjector
from tierguard.kv.guard import decode_guard
from tierguard.kv.manager import HOST, LoadPlan, StorePlan, TieredManager
from tierguard.kv.media import HostSlots, MediumContext, create_medium
from tierguard.kv.media.host import HostTier
from tierguard.kv.transfer import TransferResult, TransferSpec, TransferWorker

log = logging.getLogger("tierguard.integrations.vllm")


@dataclass
class _Load:
    req_id: str
    request_class: str
    targets: list[int]  # device blocks vLLM allocated for the load, in order
    plan: LoadPlan  # pinned host blocks / reserved slots, a prefix of `targets`
    started: float
    deadline: float
    pending_stages: int = 0
    stage_ok: dict[int, bool] = field(default_factory=dict)
    keep: int = 0
    state: str = "staging"  # staging -> handed (worker copying) | abandoned (cold jobs still running)


@dataclass
class _Store:
    plan: StorePlan
    hashes: list[int]


class TierScheduler:
    """See the module docstring. Not thread-safe: vLLM calls it from one thread."""

    def __init__(
        self,
        config: ConnectorConfig,
        fingerprint: str,
        block_bytes: int,
        engine_id: str,
        faults: FaultInjector | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.clock = clock
        self.faults = faults or FaultInjector()
        num_slots = config.host_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"kv_host_gib holds no block ({block_bytes} bytes each)")
        Path(config.host_shm_dir).mkdir(parents=True, exist_ok=True)
        shm.remove_stale(config.host_shm_dir)
        self.slab_path = shm.slab_path(config.host_shm_dir, engine_id, os.getpid())
        slab = shm.create_slab(self.slab_path, num_slots, block_bytes)
        self.host = HostTier(num_slots * block_bytes, block_bytes, slab=slab)
        ctx = MediumContext(fingerprint, block_bytes, self.faults, config.codec())
        self.media = {name: create_medium(name, ctx, opts) for name, opts in config.media.items()}
        self.manager = TieredManager(self.host, list(self.media.values()))
        self.worker = TransferWorker(block_bytes, num_threads=config.transfer_threads, faults=self.faults)
        for medium in self.media.values():
            register_cold_medium(self.worker, self.host, medium)
        self.contract = ColdContract(config.ttft_budget_ms)
        self._loads: dict[str, _Load] = {}
        self._abandoned: dict[int, _Load] = {}  # by id(): their cold jobs still run
        self._attempted: set[str] = set()  # requests that got their one load
        self._stores: dict[str, _Store] = {}  # copy out queued or running, by request
        self._queued_blocks = 0  # store queue: blocks being copied out or written behind
        self._out_loads: list[LoadOp] = []
        self._out_stores: list[StoreOp] = []
        self._jobs: dict[int, Callable[[TransferResult], None]] = {}
        self._next_job = 0
        self._c = ConnectorStats(tiers=TierStats(blocks_loaded_from={HOST: 0, **{n: 0 for n in self.media}}))
        self._load_hist = LatencyHistogram(LOAD_BUCKETS)
        self._load_seconds: list[float] = []
        self._stats_lock = threading.Lock()  # the metrics endpoint reads from its own thread
        self._watcher = FaultFileWatcher(config.fault_file, self.faults) if config.fault_file else None

    # ---- admission ----

    def lookup(self, req_id: str, hashes: list[int], start: int) -> int:
        """Leading blocks of `hashes[start:]` some tier holds; 0 once the request had its load."""
        if req_id in self._attempted or start >= len(hashes):
            return 0
        with decode_guard():
            return self.manager.lookup(hashes[start:])

    def begin_load(self, req_id: str, request_class: str, hashes: list[int], targets: list[int]) -> None:
        """vLLM allocated `targets` for the blocks `hashes` names; stage them (never waits)."""
        with decode_guard():
            self._attempted.add(req_id)
            cls = self.contract.class_of(request_class)
            plan = self.manager.prepare_load(hashes)
            now = self.clock()
            load = _Load(
                req_id, cls, list(targets), plan, now, now + self.config.load_deadline_ms[cls] / 1000.0
            )
            self._loads[req_id] = load
            self._c.tiers.loads_started += 1
            staged = plan.staged()
            load.pending_stages = len(staged)
            for name, blocks in staged.items():
                spec = TransferSpec(
                    self.media[name].spec([b.block_hash for b in blocks]),
                    HostSlots([b.host_slot for b in blocks]),
                )
                self._submit(spec, lambda r, load=load, blocks=blocks: self._on_staged(load, blocks, r))
            if not staged:
                self._hand_over(load, len(plan.blocks))

    def _on_staged(self, load: _Load, blocks: list, result: TransferResult) -> None:
        load.stage_ok.update(zip((b.block_hash for b in blocks), result.block_ok, strict=True))
        load.pending_stages -= 1
        if load.pending_stages:
            return
        keep = self.manager.complete_stage(load.plan, load.stage_ok)
        if load.state == "abandoned":
            self.manager.complete_load(load.plan, keep)  # what arrived stays in host RAM
            self._abandoned.pop(id(load), None)
            return
        if keep < len(load.plan.blocks):
            failed = sorted({b.source for b in load.plan.blocks if not load.stage_ok.get(b.block_hash, True)})
            self.contract.decide_on_failure(
                load.request_class, f"blocks from {', '.join(failed)} did not arrive"
            )
        self._hand_over(load, keep)

    def _hand_over(self, load: _Load, keep: int) -> None:
        """The first `keep` blocks are in host RAM: the worker copies them in; the rest of
        the targets are reported as load errors (recomputed)."""
        load.keep, load.state = keep, "handed"
        slots = [b.host_slot for b in load.plan.blocks[:keep]]
        self._out_loads.append(LoadOp(load.req_id, slots, load.targets[:keep], load.targets[keep:]))
        self._c.load_error_blocks += len(load.targets) - keep
        if keep == 0:
            self.manager.complete_load(load.plan, 0)
            self._finish_load(load)

    def _abandon(self, load: _Load, why: str) -> None:
        """Give the request back to vLLM now, every block in error; cold jobs end in the background."""
        load.state = "abandoned"
        self._loads.pop(load.req_id, None)
        self._out_loads.append(LoadOp(load.req_id, [], [], list(load.targets)))
        self._c.load_error_blocks += len(load.targets)
        if load.pending_stages:
            self._abandoned[id(load)] = load
        else:  # only host blocks, pinned: release them
            self.manager.complete_load(load.plan, 0)
        self._observe(self.clock() - load.started)
        log.info("load of %s abandoned: %s", load.req_id, why)

    def _finish_load(self, load: _Load) -> None:
        self._loads.pop(load.req_id, None)
        seconds = self.clock() - load.started
        c = self._c.tiers
        c.loads_done += 1
        c.blocks_loaded += load.keep
        for b in load.plan.blocks[: load.keep]:
            c.blocks_loaded_from[b.source] = c.blocks_loaded_from.get(b.source, 0) + 1
        self._observe(seconds)

    def _observe(self, seconds: float) -> None:
        with self._stats_lock:
            self._load_hist.observe(seconds)
            self._load_seconds.append(seconds)
            del self._load_seconds[:-512]

    # ---- every step ----

    def build_ops(self) -> StepOps:
        with decode_guard():
            for done in self.worker.get_finished():
                self._jobs.pop(done.job_id)(done)
            now = self.clock()
            for load in list(self._loads.values()):
                if load.state == "staging" and now > load.deadline:
                    decision = self.contract.decide_on_miss(
                        load.request_class, staged_in_time=False, can_wait=False
                    )
                    self._c.tiers.recomputes += 1
                    self._abandon(load, decision.reason)
            ops = StepOps(
                self.fingerprint, str(self.slab_path), self.host.num_slots, self.block_bytes,
                self._out_loads, self._out_stores,
            )  # fmt: skip
            self._out_loads, self._out_stores = [], []
            return ops

    def on_output(
        self, finished_recving: set[str], finished_sending: set[str], report: WorkerReport | None
    ) -> None:
        with decode_guard():
            for req_id in finished_recving:
                load = self._loads.get(req_id)
                if load is not None and load.state == "handed":
                    self.manager.complete_load(load.plan, load.keep)
                    self._finish_load(load)
            failed = report.failed_stores if report else set()
            if report and str(self.slab_path) in report.attached:
                self._unlink_slab()  # both sides map it now: nothing can leak it any more
            for req_id in finished_sending:
                store = self._stores.pop(req_id, None)
                if store is None:
                    continue
                ok = req_id not in failed
                self.manager.complete_store(store.plan, ok)
                self._queued_blocks -= len(store.plan.to_store)
                if ok:
                    self._c.tiers.offloaded_blocks += len(store.plan.to_store)
                    self._persist([h for h, _ in store.plan.to_store])

    # ---- stores ----

    def finish(self, req_id: str, hashes: list[int], block_ids: list[int]) -> bool:
        """A request ended with these full blocks computed. True: vLLM must keep the blocks
        until the worker reports the copy done (finished_sending)."""
        with decode_guard():
            self._attempted.discard(req_id)
            load = self._loads.get(req_id)
            if load is not None:  # aborted while loading: its blocks hold no KV of ours yet
                if load.state == "staging":
                    self._abandon(load, "request ended")
                return False
            n = min(len(hashes), len(block_ids))
            if n == 0 or not self.host.num_slots:
                return False
            hashes, block_ids = hashes[:n], block_ids[:n]
            if self.media:  # already in host RAM: only the write-behind may be missing
                self._persist([h for h in hashes if self.host.contains(h)])
            new = sum(1 for h in hashes if not self.host.is_present(h))
            if new == 0:
                return False
            if self._queued_blocks + new > self.config.store_queue_blocks:
                self._c.dropped_stores += 1
                self._c.dropped_store_blocks += new
                return False
            plan = self.manager.prepare_store(hashes)
            if not plan.to_store:
                return False
            by_hash = dict(zip(hashes, block_ids, strict=True))
            self._stores[req_id] = _Store(plan, hashes)
            self._queued_blocks += len(plan.to_store)
            self._out_stores.append(
                StoreOp(req_id, [by_hash[h] for h, _ in plan.to_store], [s for _, s in plan.to_store])
            )
            return True

    def _persist(self, hashes: list[int]) -> None:
        for p in self.manager.prepare_persist(hashes):
            if self._queued_blocks + len(p.blocks) > self.config.store_queue_blocks:
                self.manager.complete_persist(p, [False] * len(p.blocks))
                self._c.skipped_write_behind_blocks += len(p.blocks)
                continue
            self._queued_blocks += len(p.blocks)
            medium = self.media[p.medium]
            spec = TransferSpec(HostSlots([s for _, s in p.blocks]), medium.spec([h for h, _ in p.blocks]))
            self._submit(spec, lambda r, p=p: self._on_persisted(p, r))

    def _on_persisted(self, plan, result: TransferResult) -> None:
        self.manager.complete_persist(plan, result.block_ok)
        self._queued_blocks -= len(plan.blocks)

    def _submit(self, spec: TransferSpec, on_done: Callable[[TransferResult], None]) -> None:
        self._next_job += 1
        self._jobs[self._next_job] = on_done
        self.worker.transfer_async(self._next_job, spec)

    # ---- queries ----

    def has_pending_work(self) -> bool:
        """Ops to hand out or store copies not yet reported: vLLM keeps stepping until they
        end (a finished request's blocks are freed only then). Tier jobs do not keep it
        stepping: their completions are handled at the next step, whenever it comes (a
        load's request waits in vLLM, which steps for it anyway)."""
        return bool(self._stores or self._out_stores or self._out_loads)

    def stats(self) -> ConnectorStats:
        c = self._c
        with self._stats_lock:
            p99 = quantile_ms(list(self._load_seconds), 0.99)
            hist = self._load_hist.snapshot()
        t = c.tiers
        tiers = TierStats(
            loads_started=t.loads_started,
            loads_done=t.loads_done,
            blocks_loaded=t.blocks_loaded,
            blocks_loaded_from=dict(t.blocks_loaded_from),
            recomputes=t.recomputes,
            offloaded_blocks=t.offloaded_blocks,
            loading_seqs=len(self._loads),
            load_p99_ms=p99,
            transfer_queue_depth=self.worker.queue_depth,
            manager=self.manager.stats(),
            host=self.host.stats(),
            media={name: m.stats() for name, m in self.media.items()},
            routes=self.worker.route_stats(),
            contract=self.contract.stats(),
            latency=self.worker.latency_histograms(),
        )
        return ConnectorStats(
            load_error_blocks=c.load_error_blocks,
            dropped_stores=c.dropped_stores,
            dropped_store_blocks=c.dropped_store_blocks,
            skipped_write_behind_blocks=c.skipped_write_behind_blocks,
            store_queue_blocks=self._queued_blocks,
            tiers=tiers,
            load_latency=hist,
        )

    def reset_host(self) -> int:
        """vLLM's reset of the connector cache: host RAM forgets its unpinned blocks (the
        cold tiers keep theirs; `tierguard kv purge` empties a disk tier)."""
        return self.host.clear()

    def health(self) -> dict[str, tuple[bool, str]]:
        return {name: (bool(m.healthy), str(m.reason)) for name, m in self.media.items()}

    def close(self, timeout_s: float = 10.0) -> None:
        """Let write-behind finish (bounded), stop the threads, remove the slab."""
        if self._watcher is not None:
            self._watcher.stop()
        end = time.monotonic() + timeout_s
        while self._jobs and time.monotonic() < end:
            for done in self.worker.get_finished():
                self._jobs.pop(done.job_id)(done)
            time.sleep(0.01)
        self.worker.shutdown()
        for m in self.media.values():
            m.close()
        self._unlink_slab()

    def _unlink_slab(self) -> None:
        try:
            self.slab_path.unlink()
        except OSError:
            pass
