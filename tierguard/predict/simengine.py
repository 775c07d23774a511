"""The engine on a simulated clock: the real `LLMEngine` with its mechanism replaced.

`SimEngine` subclasses `LLMEngine` and overrides only what computes or moves bytes
(the hooks `_make_runner`, `_make_tiers`, `_naive_disk`) and passes a `SimClock`. So
`step()`, the `Scheduler`, the step budget, the SLO waves, admission, the cold contract,
the `TieredConnector`, the host tier's slots and eviction, the block manager and pool,
and the naive baseline's pager all run as they are; a new rule in any of them changes
the prediction with no change here. What is replaced, and by what:

    model runner          SimRunner: advances the clock by the step cost
                          (costmodel.py) of the schedule's shape; logits of width 1
    transfer worker       SimTransferWorker: jobs finish after the route's measured time
                          (media.py), promotions on `num_threads` simulated threads,
                          stores on the real worker's store and offload lanes under
                          its StorePolicy, in order
    cold media            SimMedium: an index of block hashes with the medium's budget
                          (LRU), no bytes
    host slab             the real HostTier, one byte per slot (its bookkeeping is real)
    naive disk            SimNaiveDisk: a page-out or page-in blocks the step (the clock
                          moves) for the measured per-block time; a block already on
                          disk is not written again (the measured repeat spill); the
                          spill tier's budget evicts least recently used blocks
    tokenizer             one character per token (no stop strings, no held text)

The simulated clock only moves when something takes time: a step's compute, an idle
pause while transfers are in flight (`LLMEngine` sleeps on its clock), the driver's
gaps between steps and waits for arrivals.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tierguard.common.units import GIB
from tierguard.engine.api import StepShape
from tierguard.engine.config import EngineConfig
from tierguard.engine.llm_engine import LLMEngine
from tierguard.kv.connector import KVConnector, TierOptions
from tierguard.kv.contract import ColdContract
from tierguard.kv.faults import FaultInjector
from tierguard.kv.manager import TieredManager
from tierguard.kv.media import BlockSpec, ColdMedium, KeyedBlocks
from tierguard.kv.media.host import HostTier
from tierguard.kv.spec import KVLayout
from tierguard.kv.store_policy import StorePolicy
from tierguard.kv.tiered_connector import TieredConnector
from tierguard.kv.transfer import STORE_RETRY_S, RouteStats, TransferResult, TransferSpec
from tierguard.model.config import ModelConfig
from tierguard.model.gemma3 import kv_groups
from tierguard.predict.costmodel import StepCost, StepNoise
from tierguard.predict.media import MediaCost

TRANSFER_THREADS = 2  # TierOptions.num_threads: the transfer worker's threads


class SimClock:
    """Simulated monotonic time (tierguard/common/clock.py's contract)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


class SimTokenizer:
    """One character per token: every token shows text at once, nothing is ever held."""

    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * len(text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(token_ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(m.get("content", "") for m in messages)


@dataclass
class SimDevicePool:
    block_bytes: int


@dataclass
class EngineSpec:
    """Everything the simulated engine is built from (the served engine's own config,
    recorded in its step log, or a generic engine's settings)."""

    config: EngineConfig
    model_config: ModelConfig
    kv_layout: KVLayout
    model_name: str = "model"


class SimRunner:
    """Stands in for ModelRunner: the step takes the cost model's time on the clock."""

    def __init__(self, spec: EngineSpec, cost: StepCost, clock: SimClock, rng: np.random.Generator | None,
                 scale: float) -> None:
        self.kv_layout = spec.kv_layout
        self.groups = kv_groups(spec.model_config)  # the pool's layer groups, as ModelRunner's
        self.compute_path = "simulated"
        self.device_pool = SimDevicePool(spec.kv_layout.block_bytes)
        self.cost, self.clock, self.rng, self.scale = cost, clock, rng, scale
        self.noise = StepNoise(cost.rho, rng) if rng is not None else None  # successive steps' residuals
        self.weight_dtype = "auto"
        self.steps = 0
        self.busy_s = 0.0

    def run(self, batch: list) -> torch.Tensor:
        shape = StepShape.of(batch)
        seconds = self.cost.step_seconds(shape, self.rng, self.scale,
                                         u=self.noise.next() if self.noise is not None else None)
        self.clock.sleep(seconds)
        self.steps += 1
        self.busy_s += seconds
        return torch.zeros((shape.sampled, 1))

    def release(self, seq_id: str) -> None:
        pass

    def extra_stats(self) -> dict[str, float]:
        return {}


class SimMedium(ColdMedium):
    """A cold medium's index and budget (least recently used out), without the bytes."""

    def __init__(self, name: str, capacity_blocks: int) -> None:
        self.name = name  # type: ignore[misc]
        self.spec = type(f"Sim{name.title()}Blocks", (KeyedBlocks,), {"medium": name})  # type: ignore[misc]
        self.capacity = max(0, capacity_blocks)
        self.healthy, self.writes_enabled, self.reason = True, True, ""
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.writes = self.reads = self.evictions = 0

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def write_many(self, items: list[tuple[int, Any]]) -> list[bool]:
        out = []
        for h, _ in items:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                out.append(True)
                continue
            while self._blocks and len(self._blocks) >= self.capacity:
                self._blocks.popitem(last=False)
                self.evictions += 1
            ok = len(self._blocks) < self.capacity
            if ok:
                self._blocks[h] = None
                self.writes += 1
            out.append(ok)
        return out

    def read_many(self, items: list[tuple[int, Any]]) -> list[bool]:
        out = []
        for h, _ in items:
            ok = h in self._blocks
            if ok:
                self._blocks.move_to_end(h)
                self.reads += 1
            out.append(ok)
        return out

    def stats(self) -> dict:
        return {"writes": self.writes, "reads": self.reads, "evictions": self.evictions}


@dataclass(order=True)
class _Job:
    done_at: float
    seq: int
    job_id: int = field(compare=False)
    spec: TransferSpec = field(compare=False)
    started: float = field(compare=False)


class SimTransferWorker:
    """The transfer worker's contract (tierguard/kv/transfer.py) on simulated time, its
    three lanes included: a promotion starts when one of `threads` is free; a store
    (`store=True`) runs one at a time on the store lane, each only once `store_policy`
    allows it (polled every STORE_RETRY_S of simulated time, as the real lane polls); a
    store that holds device blocks (`holds_device=True`) runs one at a time on the offload
    lane, never waiting for the share. Both kinds of store are charged to the share: the
    route's measured time, all of it (the measurement does not tell a copy's CPU time from
    its wait for a device, so a store is charged as if it all were copying). A job takes
    its route's measured time and is reported by `get_finished` once the clock has passed
    its end, in order; its effect on a cold medium's index (a write, a read) happens then.
    A store never delays a promotion."""

    def __init__(self, clock: SimClock, media_cost: MediaCost, media: list[SimMedium],
                 rng: np.random.Generator | None, scale: float, threads: int = TRANSFER_THREADS,
                 store_policy: StorePolicy | None = None) -> None:
        self.clock, self.cost, self.rng, self.scale = clock, media_cost, rng, scale
        self.store_policy = store_policy or StorePolicy(clock=clock.monotonic)
        self.media = {m.spec: m for m in media}
        self._free_at = [0.0] * threads
        self._store_free_at = 0.0
        self._offload_free_at = 0.0
        self._jobs: list[_Job] = []
        self._seq = 0
        self.stats: dict[str, RouteStats] = {}

    def transfer_async(self, job_id: int, spec: TransferSpec, store: bool = False, holds_device: bool = False) -> None:
        seconds = self.cost.route(spec.route_name).seconds(len(spec.src)) * self.scale
        now = self.clock.now
        if store and holds_device:
            start = max(now, self._offload_free_at)
            self._offload_free_at = start + seconds
            self.store_policy.charge(seconds)
        elif store:
            start = max(now, self._store_free_at)
            while not self.store_policy.allow_run(start):  # start times on this lane never go back
                start += STORE_RETRY_S
            self._store_free_at = start + seconds
            self.store_policy.charge(seconds)
        else:
            i = min(range(len(self._free_at)), key=self._free_at.__getitem__)
            start = max(now, self._free_at[i])
            self._free_at[i] = start + seconds
        self._seq += 1
        heapq.heappush(self._jobs, _Job(start + seconds, self._seq, job_id, spec, start))

    def get_finished(self) -> list[TransferResult]:
        out = []
        while self._jobs and self._jobs[0].done_at <= self.clock.now:
            job = heapq.heappop(self._jobs)
            ok = self._apply(job.spec)
            out.append(TransferResult(job.job_id, all(ok), ok, job.done_at - job.started, job.spec.route_name))
            s = self.stats.setdefault(job.spec.route_name, RouteStats())
            s.jobs += 1
            s.blocks += sum(ok)
        return out

    def _apply(self, spec: TransferSpec) -> list[bool]:
        src, dst = self.media.get(type(spec.src)), self.media.get(type(spec.dst))
        if dst is not None:
            return dst.write_many([(h, None) for h in dst_hashes(spec.dst)])
        if src is not None:
            return src.read_many([(h, None) for h in dst_hashes(spec.src)])
        return [True] * len(spec.src)

    @property
    def queue_depth(self) -> int:
        return len(self._jobs)

    def route_stats(self) -> dict[str, RouteStats]:
        return dict(self.stats)

    def latency_histograms(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


def dst_hashes(spec: BlockSpec) -> list[int]:
    return list(spec.hashes)  # type: ignore[attr-defined]


class _NaiveDiskStats:
    def __init__(self, owner: SimNaiveDisk) -> None:
        self.owner = owner

    def stats(self) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(reads_in_decode=self.owner.counters.restores)


class SimNaiveDisk:
    """The naive baseline's synchronous disk (tierguard/baselines/naive_kv.py): a spill
    or a restore blocks the engine thread, so the clock moves inside the step. Its index
    is the spill tier's: `capacity_blocks` block files, the least recently stored or read
    evicted first; a repeat spill of a block it holds writes nothing and does not move
    it (as `DiskTier.write` with a known hash); a restore of an evicted block misses."""

    def __init__(self, clock: SimClock, media_cost: MediaCost, rng: np.random.Generator | None, scale: float,
                 capacity_blocks: int | None = None) -> None:
        from tierguard.baselines.naive_kv import NaiveCounters

        self.clock, self.cost, self.rng, self.scale = clock, media_cost, rng, scale
        self.capacity = capacity_blocks
        self.counters = NaiveCounters()
        self.stored: OrderedDict[int, None] = OrderedDict()
        self.disk = _NaiveDiskStats(self)

    def spill(self, block_hash: int, device_block: int) -> bool:
        """A block the spill tier holds already is not written again (the disk tier's
        index names the bytes): it costs the measured repeat spill."""
        known = block_hash in self.stored
        if not known and self.capacity is not None:
            if self.capacity <= 0:
                return False
            while len(self.stored) >= self.capacity:
                self.stored.popitem(last=False)
        t = self.cost.route("naive_respill" if known else "naive_spill").seconds(1) * self.scale
        self.clock.sleep(t)
        self.stored.setdefault(block_hash, None)
        self.counters.spills += 1
        self.counters.stall_s += t
        return True

    def restore(self, block_hash: int, device_block: int) -> bool:
        if block_hash not in self.stored:
            self.counters.restore_misses += 1
            return False
        self.stored.move_to_end(block_hash)
        t = self.cost.route("naive_restore").seconds(1) * self.scale
        self.clock.sleep(t)
        self.counters.restores += 1
        self.counters.stall_s += t
        return True


class SimEngine(LLMEngine):
    """`LLMEngine` with simulated mechanism (module docstring). `scale` multiplies every
    cost (the prediction's uncertainty band); `rng` draws the step-time noise (None: the
    fitted means, deterministic)."""

    def __init__(self, spec: EngineSpec, cost: StepCost, media: MediaCost | None, clock: SimClock,
                 rng: np.random.Generator | None = None, scale: float = 1.0) -> None:
        self._sim = (spec, cost, media, rng, scale)
        config = spec.config
        super().__init__(
            None,  # type: ignore[arg-type] - no model: `_make_runner` builds the simulated one
            spec.model_config,
            SimTokenizer(),
            config,
            torch.float32,
            torch.device("cpu"),
            model_name=spec.model_name,
            clock=clock,
        )

    def _make_runner(self, model, dtype, device) -> SimRunner:  # type: ignore[override]
        spec, cost, _media, rng, scale = self._sim
        return SimRunner(spec, cost, self.clock, rng, scale)  # type: ignore[arg-type]

    def _media_cost(self) -> MediaCost:
        media = self._sim[2]
        if media is None:
            raise ValueError("this variant uses KV tiers but the calibration has no media timings")
        return media

    def _make_tiers(self, options: TierOptions, contract: ColdContract, faults: FaultInjector | None) -> KVConnector:
        _spec, _cost, _media, rng, scale = self._sim
        bb = self.runner.device_pool.block_bytes
        host = HostTier(options.host_bytes // bb, 1, pin_memory=False)  # bookkeeping only: a byte per slot
        media = [SimMedium(name, int(opts.get("capacity_bytes", 1 << 40)) // bb) for name, opts in options.media.items()]
        stores = StorePolicy(max_pending=options.store_max_pending, share=options.store_share, clock=self.clock.monotonic)
        worker = SimTransferWorker(self.clock, self._media_cost(), media, rng, scale,  # type: ignore[arg-type]
                                   store_policy=stores)
        return TieredConnector(self.pool, self.runner.device_pool, self.config.block_size,  # type: ignore[arg-type]
                               TieredManager(host, media), host, media, worker, contract,  # type: ignore[arg-type]
                               groups=self.groups, clock=self.clock)

    def _naive_disk(self) -> SimNaiveDisk:  # type: ignore[override]
        _spec, _cost, _media, rng, scale = self._sim
        from tierguard.kv.media.disk.format import HEADER_LEN

        file_bytes = HEADER_LEN + self.runner.device_pool.block_bytes  # the plaintext block file
        capacity = int(self.config.kv_disk_gib * GIB) // file_bytes
        return SimNaiveDisk(self.clock, self._media_cost(), rng, scale, capacity)  # type: ignore[arg-type]


def engine_config_from(d: dict) -> EngineConfig:
    """An EngineConfig from a recorded dict; key files are dropped (the simulated media
    store no bytes, so nothing is sealed) and unknown keys ignored."""
    known = EngineConfig.__dataclass_fields__
    d = {k: v for k, v in d.items() if k in known}
    d.update(kv_encrypt_key_file=None, kv_encrypt_old_key_file=None)
    return EngineConfig(**d)


def model_config_from(d: dict) -> ModelConfig:
    known = ModelConfig.__dataclass_fields__
    return ModelConfig(**{k: v for k, v in d.items() if k in known})
