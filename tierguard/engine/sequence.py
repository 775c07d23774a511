"""A request's state inside the engine, and a step's schedule: plain data, mutated by the
scheduler and engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from tierguard.engine.api import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued (or waiting for a KV load), holds no blocks
    RUNNING = auto()
    FINISHED_STOPPED = auto()
    FINISHED_LENGTH = auto()
    FINISHED_ABORTED = auto()

    @property
    def finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """Token ids (prompt + output), block table, and how many tokens have KV in the cache.

    Invariants: num_computed_tokens <= len(token_ids); the block table covers at least
    num_computed_tokens slots; block_hashes[i] is the prefix hash of full block i once
    that block's KV has been computed (only full, computed blocks are hashed).

    A pool split into layer groups (tierguard/kv/groups.py) gives the sequence one table
    per group, all of one length; `block_table` is group 0's (full attention). A sliding
    group's entries before its window are NULL_BLOCK (freed).
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        request_class: str = "interactive",
    ) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.request_class = request_class
        self.status = SequenceStatus.WAITING
        self.block_tables: list[list[int]] = [[]]
        self.block_hashes: list[int] = []
        # Chained hashes of full blocks of token_ids (block_manager's lookup cache; tokens
        # only grow, so they stay valid), whether or not the blocks are computed.
        self.prefix_hashes: list[int] = []
        # Parent of block 0's hash: the model's root mixed with params.cache_salt
        # (block_manager.py sets it on first use).
        self.hash_root: int | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.num_holds = 0  # steps it waited, ready, for companions' prefills (admission.py)
        self.queued_at = arrival  # when it last entered the waiting queue (admission aging)
        self.generator = None  # torch.Generator when params.seed is set
        # Its newest token's text is held back (half a character, or a possible stop
        # string): the client has seen nothing for a whole step already (scheduler).
        self.text_held = False

    @property
    def block_table(self) -> list[int]:
        """Group 0's table (full attention): every block the sequence's context covers."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        """Replace a single-group sequence's table."""
        self.block_tables = [table]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not computed yet (1 for a decoding sequence)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass
class ScheduledSeq:
    """One sequence's part of a step: the scheduler decides it, the model runner computes it."""

    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    # True when this chunk reaches the end of the sequence, so a token is sampled.
    # Fixed at scheduling time (postprocessing moves num_computed_tokens).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    """One step's decision (scheduler.py)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes (1 token) first
    preempted: list[Sequence] = field(default_factory=list)
