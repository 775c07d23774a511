"""`KVTierStore`: the one object the engine talks to; chains manager decisions and worker jobs.

The engine calls, from its own thread:
- `lookup(hashes)` while scheduling (no I/O);
- `start_load(request_id, hashes, device_blocks)` when it admits a request or starts a
  new turn whose prefix is in a tier; the request is not scheduled until `poll()` reports
  its `LoadDone`;
- `offload(hashes, device_blocks, persist)` to copy blocks out (preempted sequences:
  `persist=False`; full prefix blocks worth keeping across restarts: `persist=True`); the
  device blocks must not be overwritten until `poll()` lists them in `released_blocks`;
- `abandon(request_id)` when staging missed its deadline and the contract chose recompute;
  device blocks of an abandoned load come back through `released_blocks` once the
  in-flight copy ends (allocate fresh blocks for the recompute);
- `poll()` once per step: it never waits.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from tierguard.kv.disk_tier import DiskTier
from tierguard.kv.faults import FaultInjector
from tierguard.kv.host_tier import HostTier
from tierguard.kv.manager import LoadBlock, LookupResult, OffloadManager
from tierguard.kv.spec import DevicePool, Medium
from tierguard.kv.transfer import BlockTransfer, TransferResult, TransferSpec, TransferWorker


def quantile_ms(sorted_s: list[float], q: float) -> float:
    """Nearest-rank q-quantile of ascending latencies in seconds, in ms (0.0 when empty)."""
    if not sorted_s:
        return 0.0
    return 1000 * sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))]


@dataclass
class LoadDone:
    request_id: str
    num_blocks: int  # leading blocks now in the device blocks given to start_load
    seconds: float  # since start_load
    from_disk: int  # how many of them came from the disk tier


@dataclass
class PollResult:
    loads_done: list[LoadDone] = field(default_factory=list)
    released_blocks: list[int] = field(default_factory=list)  # device blocks free to reuse


@dataclass
class _Load:
    request_id: str
    blocks: list[LoadBlock]
    device_blocks: list[int]
    started: float
    keep: int = 0
    abandoned: bool = False


@dataclass
class _Store:
    hashes: list[int]
    device_blocks: list[int]
    persist: bool


class KVTierStore:
    def __init__(self, manager: OffloadManager, worker: TransferWorker) -> None:
        self.manager = manager
        self.worker = worker
        self._ids = itertools.count(1)
        self._jobs: dict[int, tuple[str, object]] = {}  # job id -> (kind, state)
        self._loads: dict[str, _Load] = {}

    @property
    def pending_jobs(self) -> int:
        """Transfers started and not yet reported by `poll()` (queued, running or finished)."""
        return len(self._jobs)

    @classmethod
    def create(
        cls,
        pool: DevicePool,
        fingerprint: str,
        host_bytes: int,
        disk_dir: str | None = None,
        disk_bytes: int = 0,
        *,
        num_threads: int = 2,
        faults: FaultInjector | None = None,
        allow_reads_in_decode: bool = False,
    ) -> KVTierStore:
        """Build host tier, optional disk tier, manager and worker for one device pool.

        `allow_reads_in_decode` exists only for the benchmark's `--kv-naive-sync-disk`.
        """
        host = HostTier(host_bytes, pool.block_bytes)
        disk = None
        if disk_dir is not None and disk_bytes > 0:
            disk = DiskTier(
                disk_dir, fingerprint, disk_bytes, faults=faults, allow_reads_in_decode=allow_reads_in_decode
            )
        worker = TransferWorker(host, pool=pool, disk=disk, num_threads=num_threads, faults=faults)
        return cls(OffloadManager(host, disk), worker)

    @property
    def disk(self) -> DiskTier | None:
        return self.manager.disk

    def lookup(self, hashes: list[int]) -> LookupResult:
        return self.manager.lookup(hashes)

    def _submit(self, kind: str, state: object, spec: TransferSpec) -> None:
        job_id = next(self._ids)
        self._jobs[job_id] = (kind, state)
        self.worker.transfer_async(job_id, spec)

    # ---- loads ----

    def start_load(self, request_id: str, hashes: list[int], device_blocks: list[int]) -> int:
        """Begin bringing the leading cached blocks in; returns how many will be tried.

        `hashes`: the request's full-block hashes after those already cached on the device
        (blocks past the tiers' run are counted as misses). 0 means nothing is in a tier,
        or every host slot is pinned right now (retry on a later step or recompute).
        """
        if len(device_blocks) < len(hashes):
            raise ValueError("start_load needs one device block per hash")
        if request_id in self._loads:
            raise ValueError(f"request {request_id!r} already has a load in flight")
        prepared = self.manager.prepare_load(hashes)
        if not prepared.blocks:
            return 0
        load = _Load(request_id, prepared.blocks, device_blocks[: len(prepared.blocks)], time.monotonic())
        self._loads[request_id] = load
        staged = prepared.to_stage
        if staged:
            spec = TransferSpec(
                Medium.DISK, Medium.HOST, [BlockTransfer(b.block_hash, b.host_slot) for b in staged]
            )
            self._submit("stage", load, spec)
        else:
            load.keep = len(load.blocks)
            self._submit_to_device(load)
        return len(prepared.blocks)

    def _submit_to_device(self, load: _Load) -> None:
        blocks = [
            BlockTransfer(b.block_hash, b.host_slot, d)
            for b, d in zip(load.blocks[: load.keep], load.device_blocks, strict=False)
        ]
        self._submit("load", load, TransferSpec(Medium.HOST, Medium.DEVICE, blocks))

    def abandon(self, request_id: str) -> None:
        """Stop waiting for a load; its pins and device blocks are released when its job ends."""
        load = self._loads.pop(request_id, None)
        if load is not None:
            load.abandoned = True

    # ---- stores ----

    def offload(self, hashes: list[int], device_blocks: list[int], persist: bool = False) -> list[int]:
        """Copy blocks device->host (and on to disk when `persist`); returns device blocks in use.

        Blocks already in host RAM are not copied again; their device blocks are free at once
        (they are not in the returned list). The returned blocks come back via `poll()`.
        """
        if len(device_blocks) != len(hashes):
            raise ValueError("offload needs one device block per hash")
        by_hash = dict(zip(hashes, device_blocks, strict=True))
        out = self.manager.prepare_store(hashes)
        if persist:
            already = [h for h in hashes if self.manager.host.contains(h)]
            self._persist(already)
        if not out.to_store:
            return []
        store = _Store([h for h, _ in out.to_store], [by_hash[h] for h, _ in out.to_store], persist)
        spec = TransferSpec(
            Medium.DEVICE, Medium.HOST, [BlockTransfer(h, slot, by_hash[h]) for h, slot in out.to_store]
        )
        self._submit("store", store, spec)
        return list(store.device_blocks)

    def _persist(self, hashes: list[int]) -> None:
        pinned = self.manager.prepare_persist(hashes)
        if pinned:
            spec = TransferSpec(Medium.HOST, Medium.DISK, [BlockTransfer(h, slot) for h, slot in pinned])
            self._submit("persist", [h for h, _ in pinned], spec)

    # ---- progress ----

    def poll(self) -> PollResult:
        """Advance every finished job one stage; never waits."""
        result = PollResult()
        for done in self.worker.get_finished():
            kind, state = self._jobs.pop(done.job_id)
            getattr(self, f"_on_{kind}")(state, done, result)
        return result

    def _on_stage(self, load: _Load, done: TransferResult, result: PollResult) -> None:
        load.keep = self.manager.complete_stage(load.blocks, done.block_ok)
        if load.keep and not load.abandoned:
            self._submit_to_device(load)
            return
        self.manager.complete_load([b.block_hash for b in load.blocks[: load.keep]])
        self._finish_load(load, 0, result)

    def _on_load(self, load: _Load, done: TransferResult, result: PollResult) -> None:
        self.manager.complete_load([b.block_hash for b in load.blocks[: load.keep]])
        self._finish_load(load, load.keep if done.success else 0, result)

    def _finish_load(self, load: _Load, num_blocks: int, result: PollResult) -> None:
        if load.abandoned:
            result.released_blocks.extend(load.device_blocks)
            return
        self._loads.pop(load.request_id, None)
        from_disk = sum(1 for b in load.blocks[:num_blocks] if b.source is Medium.DISK)
        result.loads_done.append(
            LoadDone(load.request_id, num_blocks, time.monotonic() - load.started, from_disk)
        )

    def _on_store(self, store: _Store, done: TransferResult, result: PollResult) -> None:
        self.manager.complete_store(store.hashes, done.success)
        result.released_blocks.extend(store.device_blocks)
        if done.success and store.persist:
            self._persist(store.hashes)

    def _on_persist(self, hashes: list[int], done: TransferResult, result: PollResult) -> None:
        self.manager.complete_persist(hashes, done.block_ok)

    # ---- signals ----

    def stats(self) -> dict[str, float]:
        """Flat counters for EngineStats.extra and /metrics (names are stable)."""
        m = self.manager
        host = m.host.stats()
        out: dict[str, float] = {
            "kv_host_bytes_used": host.used_bytes,
            "kv_host_bytes_capacity": host.capacity_bytes,
            "kv_host_hits": m.counters.host_hits,
            "kv_disk_hits": m.counters.disk_hits,
            "kv_tier_misses": m.counters.misses,
            "kv_stage_failures": m.counters.stage_failures,
            "kv_host_evictions": m.counters.host_evictions,
            "kv_store_failures": m.counters.store_failures,
            "kv_persisted_blocks": m.counters.persisted,
            "kv_transfer_queue_depth": self.worker.queue_depth,
        }
        for (src, dst), rs in list(self.worker.route_stats.items()):
            out[f"kv_transfer_{src.value}_to_{dst.value}_jobs"] = rs.jobs
            out[f"kv_transfer_{src.value}_to_{dst.value}_failed_jobs"] = rs.failed_jobs
            out[f"kv_transfer_{src.value}_to_{dst.value}_bytes"] = rs.bytes
            lat = sorted(rs.latencies_s)
            if lat:
                out[f"kv_transfer_{src.value}_to_{dst.value}_p50_ms"] = quantile_ms(lat, 0.5)
                out[f"kv_transfer_{src.value}_to_{dst.value}_p99_ms"] = quantile_ms(lat, 0.99)
        if m.disk is not None:
            d = m.disk.stats()
            out.update(
                {
                    "kv_disk_bytes_used": d.used_bytes,
                    "kv_disk_bytes_capacity": d.capacity_bytes,
                    "kv_disk_corrupt": d.corrupt,
                    "kv_disk_io_errors": d.io_errors,
                    "kv_disk_write_errors": d.write_errors,
                    "kv_disk_evictions": d.evictions,
                    "kv_disk_healthy": 1.0 if d.healthy else 0.0,
                    "kv_disk_reads_in_decode": d.reads_in_decode,
                }
            )
        return out

    def shutdown(self) -> None:
        self.worker.shutdown()
