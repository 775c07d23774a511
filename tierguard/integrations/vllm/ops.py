"""What the scheduler side tells the worker side each step, and what comes back.

The two sides of a vLLM connector may live in different processes; these plain
dataclasses are all that crosses (inside vLLM's step metadata, pickled). Every slot they
name is already pinned by the scheduler side, and every byte a `LoadOp` names is already
in host RAM: the worker never waits on a tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadOp:
    """Copy host slots into device blocks, then report the request finished receiving.

    `error_block_ids` are reported through `get_block_ids_with_load_errors` in the same
    step as the request (vLLM recomputes them); a load abandoned at its deadline is an op
    with no slots and every target block in `error_block_ids`.
    """

    req_id: str
    slots: list[int]
    block_ids: list[int]
    error_block_ids: list[int] = field(default_factory=list)


@dataclass
class StoreOp:
    """Copy device blocks of a finished request into reserved host slots."""

    req_id: str
    block_ids: list[int]
    slots: list[int]


@dataclass
class StepOps:
    fingerprint: str
    slab: str  # path of the shared host slab
    num_slots: int
    block_bytes: int
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)


@dataclass
class WorkerReport:
    """Worker -> scheduler, aggregated over workers by vLLM."""

    failed_stores: set[str] = field(default_factory=set)
    attached: set[str] = field(default_factory=set)  # slab paths the worker has mapped

    def merge(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(self.failed_stores | other.failed_stores, self.attached | other.attached)
