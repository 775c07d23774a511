"""The two sides of the vLLM connector driven in one process, the way vLLM drives them.

`Engine` owns a fake KV cache in vLLM's CPU layout ([blocks, kv heads, block size,
2 x head size] per layer), a scheduler side and a worker side, and runs vLLM's per-step
order: build the step's metadata, start the worker's copies, collect what finished, feed
it back. The thread that calls `step()` plays vLLM's forward thread. No vLLM import.
`clock` (a callable, as `time.monotonic`) pins the time the scheduler side reads for its
load deadlines; `worker_cls` swaps the worker side (a subclass that injects a fault).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierguard.integrations.vllm.config import ConnectorConfig, parse_config
from tierguard.integrations.vllm.layout import BlockGeometry, RequestHashes, request_salt
from tierguard.integrations.vllm.scheduler import TierScheduler
from tierguard.integrations.vllm.worker import TierWorker
from tierguard.kv.faults import FaultInjector

BLOCK = 4  # tokens per block
HEADS, HEAD = 2, 8
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NUM_BLOCKS = 64
FP = "00112233445566aa"


def geometry() -> BlockGeometry:
    page = HEADS * BLOCK * 2 * HEAD * 2  # bfloat16
    return BlockGeometry(LAYERS, BLOCK, HEADS, HEAD, "bfloat16", page)


def config(tmp: Path, **extra) -> ConnectorConfig:
    opts = {"kv_host_gib": 0.001, "host_shm_dir": str(tmp / "shm"), **extra}
    return parse_config(opts)


@dataclass
class Step:
    recved: set[str] = field(default_factory=set)
    sent: set[str] = field(default_factory=set)
    errors: set[int] = field(default_factory=set)


class Engine:
    def __init__(
        self, cfg: ConnectorConfig, faults: FaultInjector | None = None, scheduler_cls=TierScheduler,
        clock=None, worker_cls=TierWorker,
    ):
        geo = geometry()
        self.kv = {n: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16) for n in LAYERS}
        timing = {} if clock is None else {"clock": clock}  # the scheduler side's deadlines read it
        self.sched = scheduler_cls(cfg, FP, geo.block_bytes, "test-engine", faults=faults, **timing)
        self.worker = worker_cls(geo)
        self.worker.register(self.kv)
        self._finished_ids: set[str] = set()
        self._next_free = 0

    def alloc(self, n: int) -> list[int]:
        out = list(range(self._next_free, self._next_free + n))
        self._next_free += n
        assert self._next_free <= NUM_BLOCKS
        return out

    def fill(self, block_ids: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in self.kv.values():
            for b in block_ids:
                t[b] = torch.randn(t[b].shape, generator=g).to(t.dtype)

    def blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        return [t[b].clone() for t in self.kv.values() for b in block_ids]

    def step(self) -> Step:
        ops = self.sched.build_ops()
        self.worker.start(ops)
        sent, recved = self.worker.finished(self._finished_ids)
        self._finished_ids = set()
        errors = self.worker.load_errors()
        self.sched.on_output(recved, sent, self.worker.report())
        return Step(recved, sent, errors)

    def finish(self, req_id: str, hashes: list[int], block_ids: list[int]) -> bool:
        delay = self.sched.finish(req_id, hashes, block_ids)
        self._finished_ids.add(req_id)
        return delay

    def run_until(self, pred, timeout_s: float = 20.0) -> list[Step]:
        steps = []
        end = time.monotonic() + timeout_s
        while True:
            steps.append(self.step())
            if pred(steps):
                return steps
            if time.monotonic() > end:
                raise TimeoutError("the engine never got there")
            time.sleep(0.002)

    def store(self, req_id: str, hashes: list[int], block_ids: list[int]) -> None:
        """Finish a request and step until its copy out and write-behind are done."""
        self.finish(req_id, hashes, block_ids)
        self.run_until(lambda s: req_id in s[-1].sent or not self.sched.has_pending_work())
        self.run_until(lambda s: not self.sched._jobs)

    def load(
        self, req_id: str, hashes: list[int], request_class: str = "interactive"
    ) -> tuple[list[int], Step]:
        """Admit a request whose prefix some tier holds: lookup, allocate, begin, step until
        the worker reports it. Returns (target blocks, the step that reported it)."""
        n = self.sched.lookup(req_id, hashes, 0)
        targets = self.alloc(n)
        self.sched.begin_load(req_id, request_class, hashes[:n], targets)
        steps = self.run_until(lambda s: req_id in s[-1].recved)
        return targets, steps[-1]

    def close(self) -> None:
        self.worker.close()
        self.sched.close()


class PinnedClock:
    """The scheduler side's clock, moved only by the test (`clock.t += 0.125`)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class HeldFaults(FaultInjector):
    """A device that stalls until the test lets it go: every `check(op)` of the held
    operation waits for `release` (a hang guard of a minute, not a bound), so what the
    test sees while it is held does not depend on how fast anything runs."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.reached = threading.Event()  # some job is inside the held operation
        self.release = threading.Event()

    def check(self, op: str) -> None:
        if op == self.op:
            self.reached.set()
            self.release.wait(60)
        super().check(op)


def hashes_of(tokens: list[int]) -> list[int]:
    return RequestHashes(request_salt(FP, None), BLOCK).upto(tokens, len(tokens))
