"""Engine configuration, validated at construction (raises TierguardError, never asserts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB


@dataclass
class EngineConfig:
    num_blocks: int  # KV blocks in the device pool
    block_size: int = 16  # tokens per block
    max_num_seqs: int = 128  # sequences running at once
    max_num_batched_tokens: int = 1024  # tokens per step (decodes + prefill chunks)
    max_model_len: int = 2048  # prompt + output limit per request
    enable_prefix_caching: bool = True
    # Tiered KV store (tierguard/kv/connector.py); off when no budget is set.
    kv_host_gib: float = 0.0  # host-RAM tier budget
    kv_disk_dir: str | None = None  # NVMe tier directory (shorthand for kv_media["disk"])
    kv_disk_gib: float = 0.0  # NVMe tier budget
    # Further cold media by registered name -> options (tierguard/kv/media/base.py); a new
    # medium is configured here without a new engine setting.
    kv_media: dict[str, dict[str, Any]] = field(default_factory=dict)
    ttft_budget_ms: dict[str, float] | None = None  # per request class; None: the contract's defaults
    naive_sync_disk: bool = False  # benchmark only: spill running sequences to disk, read back in-step
    kv_dtype: str = "auto"  # device KV pool: auto (model dtype), fp8 or int8 (+ per-token-head scales)
    # A step that carries decodes stays under this (prefill chunks are cut; step_budget.py); 0: no limit.
    target_itl_ms: float = 0.0
    # Latency first (step_budget.py): steps with decodes under this, and new sequences
    # start only while the decode step leaves prefill room under it; 0: off.
    itl_slo_ms: float = 0.0
    # Throughput side of --target-itl-ms: prefill time a step with decodes may add, as a
    # multiple of the decode step's own time (step_budget.py).
    prefill_share: float = 1.0
    # Decode-only steps of up to this many sequences run on static buffers, captured as
    # CUDA graphs on CUDA (decode_graphs.py); 0: off. Eager on the CPU (tests only).
    decode_graph_max_batch: int = 0
    # Cold KV at rest (tierguard/kv/media/aead_codec.py): AES-256-GCM key files for every cold
    # medium, the old key of a rotation, and the disk tier's time to live (0: none).
    kv_encrypt_key_file: str | None = None
    kv_encrypt_old_key_file: str | None = None
    kv_disk_ttl_s: float = 0.0
    # Offload stores (copies nobody waits for yet) under backpressure (tierguard/kv/store_policy.py):
    # at most this share of one core, and this many stores waiting or running; past it a store is dropped.
    kv_store_share: float = 0.1
    kv_store_max_pending: int = 4

    def __post_init__(self) -> None:
        if not (isinstance(self.kv_store_share, int | float) and 0 < self.kv_store_share <= 1):
            raise TierguardError(f"kv_store_share must be in (0, 1], got {self.kv_store_share!r}")
        if not isinstance(self.kv_store_max_pending, int) or self.kv_store_max_pending < 1:
            raise TierguardError(f"kv_store_max_pending must be a positive integer, got {self.kv_store_max_pending!r}")
        if self.kv_dtype not in ("auto", "fp8", "int8"):
            raise TierguardError(f"--kv-dtype must be auto, fp8 or int8, got {self.kv_dtype!r}")
        if not isinstance(self.target_itl_ms, int | float) or self.target_itl_ms < 0:
            raise TierguardError(f"--target-itl-ms must be >= 0 (0: no limit), got {self.target_itl_ms!r}")
        if not isinstance(self.prefill_share, int | float) or self.prefill_share < 0:
            raise TierguardError(f"--prefill-share must be >= 0, got {self.prefill_share!r}")
        if not isinstance(self.itl_slo_ms, int | float) or self.itl_slo_ms < 0:
            raise TierguardError(f"--itl-slo-ms must be >= 0 (0: off), got {self.itl_slo_ms!r}")
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
    def tiers_enabled(self) -> bool:
        return self.kv_host_gib > 0 or bool(self.media_options())

    def media_options(self) -> dict[str, dict[str, Any]]:
        """Cold media in lookup order: the disk shorthand first, then `kv_media`."""
        media: dict[str, dict[str, Any]] = {}
        if self.kv_disk_dir is not None and self.kv_disk_gib > 0:
            media["disk"] = {"dir": self.kv_disk_dir, "capacity_bytes": int(self.kv_disk_gib * GIB)}
            if self.kv_disk_ttl_s > 0:
                media["disk"]["ttl_s"] = self.kv_disk_ttl_s
        media.update(self.kv_media)
        return media

    def validate_tiers(self) -> None:
        """Tier settings; called by LLMEngine (kept apart from __post_init__'s core checks)."""
        for name in ("kv_host_gib", "kv_disk_gib"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise TierguardError(
                    f"engine setting {name} must be a non-negative number of GiB, got {value!r}"
                )
        if self.kv_disk_gib > 0 and not self.kv_disk_dir:
            raise TierguardError("a KV disk budget (--kv-disk-gib) needs a directory (--kv-disk-dir)")
        if self.kv_disk_dir and self.kv_disk_gib <= 0:
            raise TierguardError("--kv-disk-dir needs a positive --kv-disk-gib")
        if self.naive_sync_disk and not (self.kv_disk_dir and self.kv_disk_gib > 0):
            raise TierguardError("--kv-naive-sync-disk needs a disk tier (--kv-disk-dir and --kv-disk-gib)")
        if self.naive_sync_disk and self.kv_encrypt_key_file:
            raise TierguardError(
                "--kv-naive-sync-disk (a benchmark mode) spills unencrypted; drop --kv-encrypt-key-file"
            )
        if self.kv_encrypt_old_key_file and not self.kv_encrypt_key_file:
            raise TierguardError(
                "--kv-encrypt-old-key-file needs --kv-encrypt-key-file (the key new blocks are sealed with)"
            )
        if not (isinstance(self.kv_disk_ttl_s, int | float) and 0 <= self.kv_disk_ttl_s < float("inf")):
            raise TierguardError(
                f"--kv-disk-ttl-s must be a non-negative number of seconds, got {self.kv_disk_ttl_s!r}"
            )
        if self.kv_disk_ttl_s > 0 and not (self.kv_disk_dir and self.kv_disk_gib > 0):
            raise TierguardError("--kv-disk-ttl-s needs a disk tier (--kv-disk-dir and --kv-disk-gib)")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
