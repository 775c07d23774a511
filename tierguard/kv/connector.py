"""The KV connector contract: the one object the engine knows about tiers.

Shaped like the scheduler side of vLLM's `KVConnectorBase_V1`, so the same policy could
sit inside vLLM. The scheduler calls it at four hooks, all from the engine thread, and
none of the calls waits on a transfer:

    admission   get_num_matched(seq, match) -> (tokens, load_async)
                start_load(seq, match)      stage the tier-resident prefix; the sequence
                                            leaves the queue until poll() hands it back
    free        offload(seq, preempted)     copy its full blocks out (write-behind)
    every step  poll() -> PollResult        finished loads, released device blocks
    abort       abort(seq)                  drop its load and per-request state

`TieredConnector` (tiered_connector.py) is the implementation over host RAM and the
cold media; it owns all per-request load state, one record per load. A finished load
publishes its blocks in the device prefix cache, so re-admission finds them as ordinary
prefix hits; the scheduler never sees a half-loaded sequence.

What goes where (the cold contract, see contract.py and docs/cold-contract.md):
- a finished sequence's full blocks go to host RAM and, behind that, to every cold
  medium that accepts writes (prefix blocks worth keeping across restarts);
- a preempted sequence's full blocks go to host RAM only (a running sequence is never
  pushed to disk); what host RAM cannot take is recomputed later;
- blocks that miss on the device but sit in host RAM or a cold medium are staged at
  admission, bounded by a deadline from the class's TTFT budget: past it, interactive
  recomputes and batch keeps waiting.

`NoConnector` is the connector of an engine without tiers: every hook does nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierguard.common.histogram import LatencyHistogram
from tierguard.common.stats import counter, gauge, group
from tierguard.kv.contract import ContractStats
from tierguard.kv.manager import ManagerStats
from tierguard.kv.media.block_format import IDENTITY, BlockCodec
from tierguard.kv.media.host import HostTierStats
from tierguard.kv.transfer import RouteStats


class ConnectedSeq(Protocol):
    """What the connector reads of a sequence (tierguard.engine.sequence.Sequence)."""

    seq_id: str
    token_ids: list[int]
    block_table: list[int]
    block_hashes: list[int]
    request_class: str


class DeviceBlockPool(Protocol):
    """What the connector does to the device pool (tierguard.engine.block_pool.BlockPool)."""

    def allocate(self) -> int: ...

    def acquire(self, block_id: int) -> None: ...

    def release(self, block_id: int) -> None: ...

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> bool: ...

    def take_evicted(self) -> list[int]: ...


class Match(Protocol):
    """A device prefix-cache match (tierguard.engine.block_manager.PrefixMatch)."""

    block_ids: list[int]
    hashes: list[int]
    missed_hashes: list[int]  # full-block hashes after the first device miss


@dataclass
class PollResult:
    finished_loads: list[Any] = field(default_factory=list)  # sequences to requeue at the front
    released_blocks: list[int] = field(default_factory=list)  # device blocks no longer held


@dataclass
class TierOptions:
    """What the engine configures: host RAM, cold media by registered name, the contract."""

    host_bytes: int
    media: dict[str, dict[str, Any]] = field(default_factory=dict)
    ttft_budget_ms: dict[str, float] | None = None
    num_threads: int = 2
    codec: BlockCodec = IDENTITY  # how cold media store a block (an encrypting codec goes here)


@dataclass
class TierStats:
    """Every tier signal, typed; exported with the prefix `kv_` (see tierguard/common/stats.py)."""

    loads_started: int = counter("Prefix loads staged from host RAM or a cold tier.")
    loads_done: int = counter("Prefix loads finished (successfully or not).")
    blocks_loaded: int = counter("Blocks loaded into the device pool.")
    blocks_loaded_from: dict[str, int] = counter(
        "Blocks loaded that came from a cold tier.", "blocks_loaded_from_{key}", {}
    )
    recomputes: int = counter("Loads abandoned at their deadline; prefix recomputed.", "tier_recomputes")
    async_handoffs: int = counter("Interactive requests moved to the batch path at a deadline.")
    swap_out_blocks: int = counter("Blocks of preempted sequences swapped to host RAM.")
    swap_recompute_blocks: int = counter("Blocks of preempted sequences host RAM could not take.")
    offloaded_blocks: int = counter("Blocks of finished sequences copied to host RAM.")
    device_evictions_uncopied: int = counter("Prefix blocks evicted from the device with no tier copy.")
    loading_seqs: int = gauge("Sequences waiting for a load.")
    pinned_blocks: int = gauge("Device blocks pinned by in-flight offloads or abandoned loads.")
    load_p99_ms: float = gauge("p99 prefix load time over the recent window, ms.")
    transfer_queue_depth: int = gauge("Transfer jobs queued or running.")
    manager: ManagerStats = group("", ManagerStats)
    host: HostTierStats = group("host_", HostTierStats)
    media: dict[str, Any] = group("{key}_")
    routes: dict[str, RouteStats] = group("transfer_{key}_")
    contract: ContractStats = group("", ContractStats)
    latency: dict[str, LatencyHistogram] = field(default_factory=dict)  # per route, for /metrics


class KVConnector(ABC):
    """The scheduler-side connector contract (see the module docstring for the hooks).

    Every method is called from the engine thread, one at a time; none may wait on a
    transfer or do disk or network I/O (copies run elsewhere and finish in `poll`). A
    failure in a tier never reaches the caller as an exception: it shows as fewer blocks
    loaded (the rest recomputes) or fewer blocks stored.
    """

    @abstractmethod
    def get_num_matched(self, seq: ConnectedSeq, match: Match) -> tuple[int, bool]:
        """How many tokens after the device hits some tier holds, and whether they must be
        loaded asynchronously before the sequence runs.

        Args:
            seq: a waiting sequence the scheduler is about to admit.
            match: its device prefix-cache match (`missed_hashes`: the full blocks after
                the first device miss).

        Returns:
            (tokens, load_async). (0, False) means admit it now and compute those tokens.
            An implementation looks at most once per stage of work (from the first call
            until the sequence is preempted or aborted) and answers (0, False) after
            that, so a sequence whose load ended or was abandoned is admitted and
            computes what did not arrive.
        """

    @abstractmethod
    def start_load(self, seq: ConnectedSeq, match: Match) -> bool:
        """Stage the tier-resident blocks after `match` into newly allocated device blocks.

        The caller checked that the pool has room for the whole remaining prompt. Returns
        True when a load started: the sequence leaves the queue, and the connector holds
        references on its device hits and target blocks until `poll` hands it back (the
        arrived blocks are then published in the device prefix cache, so re-admission
        finds them as ordinary hits) or until `abort` (targets still being filled are
        released when their copy ends). False: nothing was taken; the sequence is
        admitted as is.
        """

    @abstractmethod
    def offload(self, seq: ConnectedSeq, preempted: bool) -> None:
        """A running sequence leaves the device (`preempted`, or finished): start copying
        its full blocks out. Called before the scheduler frees them; the connector keeps
        its own references on the source blocks until their copy ends (`poll` returns
        them in `released_blocks`). What the tiers cannot take is recomputed later.
        """

    @abstractmethod
    def poll(self) -> PollResult:
        """Advance transfers and deadlines; never waits. Returns the sequences whose
        loads ended (to requeue at the front: each at most once, and never one that was
        aborted) and the device blocks the connector stopped holding."""

    @abstractmethod
    def abort(self, seq: ConnectedSeq) -> None:
        """The sequence is gone (finished or aborted): drop its load, if any, and what is
        known about it. Idempotent; `poll` never hands it back afterwards."""

    def busy(self) -> bool:
        """True while a load or a transfer is outstanding: the engine keeps polling."""
        return False

    def held_refs(self) -> Counter[int]:
        """References held on device blocks, for the engine's integrity check."""
        return Counter()

    def stats(self, max_age_s: float = 0.0) -> TierStats | None:
        """The tiers' signals (None without tiers); may be up to `max_age_s` old."""
        return None

    def health(self) -> dict[str, tuple[bool, str]] | None:
        """(healthy, reason) per cold medium; None without tiers."""
        return None

    def close(self, timeout_s: float = 10.0) -> None:  # noqa: B027 - nothing to close by default
        """Let in-flight writes finish (bounded by `timeout_s`), then stop; no hook is
        called afterwards."""


class NoConnector(KVConnector):
    """No tiers: nothing is ever in a tier, nothing is copied out."""

    def get_num_matched(self, seq: ConnectedSeq, match: Match) -> tuple[int, bool]:
        return 0, False

    def start_load(self, seq: ConnectedSeq, match: Match) -> bool:
        return False

    def offload(self, seq: ConnectedSeq, preempted: bool) -> None:
        pass

    def poll(self) -> PollResult:
        return PollResult()

    def abort(self, seq: ConnectedSeq) -> None:
        pass
