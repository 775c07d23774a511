"""Engine configuration, validated at construction (raises TierguardError, never asserts)."""

from __future__ import annotations

from dataclasses import dataclass

from tierguard.common.errors import TierguardError


@dataclass
class EngineConfig:
    num_blocks: int  # KV blocks in the device pool
    block_size: int = 16  # tokens per block
    max_num_seqs: int = 128  # sequences running at once
    max_num_batched_tokens: int = 1024  # tokens per step (decodes + prefill chunks)
    max_model_len: int = 2048  # prompt + output limit per request
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TierguardError(f"engine setting {name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in the same step.
            raise TierguardError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
