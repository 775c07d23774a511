"""The engine's half of the tiered KV store: swap-out, prefix offload, staged loads, the contract.

`EngineTiers` sits between the scheduler and `tierguard.kv.KVTierStore`. Every call comes
from the engine thread and none waits on a transfer:

- a finished sequence's full blocks are offloaded to host RAM (and persisted to disk when
  a disk tier is configured): write-behind, on the transfer worker;
- a preempted sequence's full blocks are swapped out to host RAM only (a running
  sequence is never pushed to disk); what host RAM cannot take is recomputed later;
- on admission, blocks that miss on the device but hit host/disk are staged: the
  sequence is LOADING (not schedulable) until `poll()` reports its `LoadDone`; a staging
  deadline from its class TTFT budget bounds the wait (interactive: recompute; batch: wait).

Device blocks owned here (references held on the pool):

    loading   the cache-hit blocks a LOADING sequence keeps, and the blocks being filled
    pinned    blocks under an in-flight offload or abandoned load; released only when
              `poll()` lists them in `released_blocks`

so the pool's integrity check reads: free + cached + used(running + loading + pinned) == total.

`--kv-naive-sync-disk` (benchmarks only) replaces the swap path with `NaivePager`
(naive_pager.py): running sequences are paged out to the disk tier and read back
synchronously inside the step that needs them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from tierguard.common.units import GIB
from tierguard.engine.block_manager import PrefixMatch
from tierguard.engine.block_pool import BlockPool
from tierguard.engine.config import EngineConfig
from tierguard.engine.naive_pager import NaivePager
from tierguard.engine.sequence import Sequence, SequenceStatus
from tierguard.kv.contract import BATCH, REQUEST_CLASSES, ColdContract, classify_request
from tierguard.kv.faults import FaultInjector
from tierguard.kv.naive import NaiveSyncDisk
from tierguard.kv.spec import DevicePool
from tierguard.kv.store import KVTierStore, LoadDone, quantile_ms

# While a LOADING sequence or an in-flight transfer is the only work, a step sleeps this
# long instead of spinning (the engine never waits *for* a transfer; it just idles).
IDLE_SLEEP_S = 0.0005


@dataclass
class _Loading:
    seq: Sequence
    held: list[int]  # device cache hits at the head of the sequence (references held)
    targets: list[int]  # device blocks the store fills, in order (references held)
    hashes: list[int]  # hash of each target
    deadline: float
    decided: bool = False  # the contract already chose to keep waiting


@dataclass
class TierCounters:
    loads_started: int = 0
    loads_done: int = 0
    blocks_loaded: int = 0
    blocks_loaded_from_disk: int = 0
    recomputes: int = 0  # loads abandoned at their deadline, prefix recomputed
    async_handoffs: int = 0  # interactive requests moved to the batch path at a deadline
    swap_out_blocks: int = 0
    swap_recompute_blocks: int = 0  # preempted blocks host RAM could not take
    offloaded_blocks: int = 0
    evicted_uncopied: int = 0  # prefix blocks that left the device with no copy in a tier
    load_seconds: list[float] = field(default_factory=list)


class EngineTiers:
    def __init__(
        self,
        config: EngineConfig,
        pool: BlockPool,
        device_pool: DevicePool,
        fingerprint: str,
        faults: FaultInjector | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.block_size = config.block_size
        disk_bytes = int(config.kv_disk_gib * GIB) if config.kv_disk_dir else 0
        self.store = KVTierStore.create(
            device_pool,
            fingerprint,
            int(config.kv_host_gib * GIB),
            config.kv_disk_dir,
            disk_bytes,
            faults=faults,
            allow_reads_in_decode=config.naive_sync_disk,
        )
        self.contract = ColdContract(config.ttft_budget_ms)
        self.pager: NaivePager | None = None
        if config.naive_sync_disk and self.store.disk is not None:
            self.pager = NaivePager(pool, NaiveSyncDisk(device_pool, self.store.disk), config.block_size)
        self.loading: dict[str, _Loading] = {}
        self.pins: Counter[int] = Counter()
        self.counters = TierCounters()
        self._stats_cache: dict[str, float] | None = None
        pool.on_evict = self._on_device_evict
        self._stats_at = 0.0

    # ---- queries ----

    @property
    def disk_health(self) -> tuple[bool, str]:
        disk = self.store.disk
        if disk is None:
            return True, ""
        return bool(disk.healthy), str(disk.reason)

    def busy(self) -> bool:
        """True while a load or a transfer is outstanding (the engine keeps polling)."""
        return bool(self.loading or self.pins or self._jobs_outstanding())

    def _jobs_outstanding(self) -> int:
        # Jobs submitted and not yet seen by poll(): a finished store still has to be
        # polled to submit its write-behind to disk.
        return self.store.pending_jobs or self.store.worker.queue_depth

    def held_refs(self) -> Counter[int]:
        """References this object holds on pool blocks (for the engine's integrity check)."""
        refs: Counter[int] = Counter(self.pins)
        for st in self.loading.values():
            refs.update(st.held)
            refs.update(st.targets)
        return refs

    def request_class(self, seq: Sequence) -> str:
        if seq.request_class in REQUEST_CLASSES:
            return seq.request_class
        return classify_request({"service_tier": seq.request_class})

    # ---- admission: staging from host/disk ----

    def start_load(self, seq: Sequence, match: PrefixMatch) -> bool:
        """Stage the tier-resident blocks after the device hits; True if `seq` is now LOADING.

        The caller checked that the pool has room for the whole remaining prompt.
        """
        if not match.missed_hashes:
            return False
        avail = self.store.lookup(match.missed_hashes).num_available
        if avail == 0:
            return False
        # Hold the device hits first: allocating targets may otherwise evict them.
        for b in match.block_ids:
            self.pool.acquire(b)
        targets = [self.pool.allocate() for _ in range(avail)]
        hashes = match.missed_hashes[:avail]
        n = self.store.start_load(seq.seq_id, hashes, targets)
        for b in targets[n:]:
            self.pool.release(b)
        if n == 0:
            for b in match.block_ids:
                self.pool.release(b)
            return False
        now = time.monotonic()
        # The stage starts now (admission or restore), not at arrival: a request that queued
        # for room must not lose its staging window to the queueing.
        deadline = self.contract.staging_deadline(self.request_class(seq), now)
        self.loading[seq.seq_id] = _Loading(seq, list(match.block_ids), targets[:n], hashes[:n], deadline)
        seq.status = SequenceStatus.LOADING
        self.counters.loads_started += 1
        return True

    def poll(self) -> list[Sequence]:
        """Advance transfers and deadlines; returns sequences ready to be admitted again."""
        result = self.store.poll()
        for b in result.released_blocks:
            self._unpin(b)
        ready = [seq for done in result.loads_done if (seq := self._finish_load(done)) is not None]
        now = time.monotonic()
        for st in list(self.loading.values()):
            if not st.decided and now > st.deadline:
                seq = self._on_deadline(st)
                if seq is not None:
                    ready.append(seq)
        return ready

    def _finish_load(self, done: LoadDone) -> Sequence | None:
        st = self.loading.pop(done.request_id, None)
        if st is None:
            return None
        seq, bs = st.seq, self.block_size
        first = len(st.held)
        # Publish what arrived under its hash: admission then finds it as a device hit.
        for i in range(done.num_blocks):
            j = first + i
            self.pool.register(st.targets[i], st.hashes[i], tuple(seq.token_ids[j * bs : (j + 1) * bs]))
        for b in st.held + st.targets:
            self.pool.release(b)
        c = self.counters
        c.loads_done += 1
        c.blocks_loaded += done.num_blocks
        c.blocks_loaded_from_disk += done.from_disk
        c.load_seconds.append(done.seconds)
        del c.load_seconds[:-512]
        seq.status = SequenceStatus.WAITING
        return seq

    def _on_deadline(self, st: _Loading) -> Sequence | None:
        cls = self.request_class(st.seq)
        decision = self.contract.decide_on_miss(cls, staged_in_time=False)
        if decision.action == "wait":
            st.decided = True
            return None
        if decision.action == "async":
            st.seq.request_class = BATCH
            st.decided = True
            self.counters.async_handoffs += 1
            return None
        self.counters.recomputes += 1
        self._drop_load(st)
        st.seq.status = SequenceStatus.WAITING
        return st.seq

    def _drop_load(self, st: _Loading) -> None:
        """Abandon a load: its targets stay pinned until the store releases them."""
        self.loading.pop(st.seq.seq_id, None)
        self.store.abandon(st.seq.seq_id)
        self.pins.update(st.targets)
        for b in st.held:
            self.pool.release(b)

    def abort_loading(self, seq: Sequence) -> bool:
        st = self.loading.get(seq.seq_id)
        if st is None:
            return False
        self._drop_load(st)
        return True

    # ---- sequences leaving the device ----

    def on_free(self, seq: Sequence, preempted: bool) -> None:
        """Copy out a sequence's full blocks before the scheduler releases them."""
        n = min(len(seq.block_hashes), len(seq.block_table))
        if n == 0:
            return
        hashes, blocks = list(seq.block_hashes[:n]), seq.block_table[:n]
        if preempted and self.pager is not None:
            return  # naive mode pages running sequences out itself; a fallback preemption recomputes
        persist = not preempted and self.store.disk is not None
        in_flight = self.store.offload(hashes, blocks, persist=persist)
        for b in in_flight:
            self.pool.acquire(b)
            self.pins[b] += 1
        if preempted:
            present = sum(1 for h in hashes if self.store.manager.host.is_present(h))
            self.counters.swap_out_blocks += present
            self.counters.swap_recompute_blocks += n - present
        else:
            self.counters.offloaded_blocks += len(in_flight)

    def _on_device_evict(self, block_id: int, block_hash: int) -> None:
        """Pool hook, before a cached block is reused. Copies were made when the block's
        sequence ended (an async copy here would have to delay the reuse), so this only
        counts prefix blocks lost for good: a sign the host tier is too small."""
        disk = self.store.disk
        if not self.store.manager.host.contains(block_hash) and not (disk and disk.contains(block_hash)):
            self.counters.evicted_uncopied += 1

    def _unpin(self, block_id: int) -> None:
        if self.pins[block_id] <= 0:
            return
        self.pins[block_id] -= 1
        if self.pins[block_id] == 0:
            del self.pins[block_id]
        self.pool.release(block_id)

    def forget(self, seq: Sequence) -> None:
        if self.pager is not None:
            self.pager.forget(seq)

    # ---- signals and shutdown ----

    def stats(self, max_age_s: float = 0.0) -> dict[str, float]:
        """Counters for EngineStats.extra. The async engine asks after every step and the
        percentiles sort latency windows, so it accepts values up to `max_age_s` old."""
        now = time.monotonic()
        # Fresh whenever nothing is in flight: the last values before the engine idles are exact.
        if self._stats_cache is None or now - self._stats_at >= max_age_s or not self.busy():
            self._stats_cache, self._stats_at = self._compute_stats(), now
        return self._stats_cache

    def _compute_stats(self) -> dict[str, float]:
        c = self.counters
        out = dict(self.store.stats())
        out.update(self.contract.stats())
        out.update(
            {
                "kv_loads_started": float(c.loads_started),
                "kv_loads_done": float(c.loads_done),
                "kv_blocks_loaded": float(c.blocks_loaded),
                "kv_blocks_loaded_from_disk": float(c.blocks_loaded_from_disk),
                "kv_tier_recomputes": float(c.recomputes),
                "kv_async_handoffs": float(c.async_handoffs),
                "kv_swap_out_blocks": float(c.swap_out_blocks),
                "kv_swap_recompute_blocks": float(c.swap_recompute_blocks),
                "kv_offloaded_blocks": float(c.offloaded_blocks),
                "kv_device_evictions_uncopied": float(c.evicted_uncopied),
                "kv_loading_seqs": float(len(self.loading)),
                "kv_pinned_blocks": float(sum(self.pins.values())),
                "kv_load_p99_ms": quantile_ms(sorted(c.load_seconds), 0.99),
            }
        )
        if self.pager is not None:
            out.update(self.pager.stats())
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Let in-flight stores and disk writes finish (bounded), then stop the workers."""
        end = time.monotonic() + timeout_s
        for st in list(self.loading.values()):
            self._drop_load(st)
        while time.monotonic() < end and (self.pins or self._jobs_outstanding()):
            for b in self.store.poll().released_blocks:
                self._unpin(b)
            time.sleep(0.005)
        self.store.shutdown()
