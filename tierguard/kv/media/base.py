"""Media: where a block's bytes can be, as open classes, and the registry of cold media.

Two kinds of spec (vLLM's `LoadStoreSpec`) say where a transfer's blocks are:
- addressed by slot: `DeviceBlocks` (device pool block ids), `HostSlots` (host slab rows);
- addressed by chained block hash: a `KeyedBlocks` subclass per cold medium
  (`DiskBlocks` in disk/tier.py, `RemoteBlocks` in remote/tier.py).
The transfer worker routes a job by the (source spec class, destination spec class) pair
(`TransferWorker.register_handler`), so a new medium brings its spec class and needs no
change to the worker, the manager or the engine.

A cold medium is a keyed store below host RAM. Blocks reach it only from host RAM
(write-behind of prefix blocks) and leave it only into host RAM (staging), both on the
transfer worker's threads; `contains` is an index lookup that the scheduler may call
anywhere, including inside a decode step.

Adding a medium: one module that subclasses `ColdMedium` (and `KeyedBlocks`) and calls
`register_medium(name, factory)` at import, plus its module path in `BUILTIN_MEDIA` (or
an import of that module before the engine starts). Configure it with
`EngineConfig.kv_media[name] = {options}`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from tierguard.common.errors import TierguardError
from tierguard.kv.faults import FaultInjector
from tierguard.kv.media.block_format import IDENTITY, BlockCodec


class BlockSpec:
    """Where the blocks of one side of a transfer are. `medium` names it in routes and stats."""

    medium: ClassVar[str] = ""

    def __len__(self) -> int:
        raise NotImplementedError


@dataclass
class DeviceBlocks(BlockSpec):
    medium: ClassVar[str] = "device"
    block_ids: list[int]

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class HostSlots(BlockSpec):
    medium: ClassVar[str] = "host"
    slots: list[int]

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class KeyedBlocks(BlockSpec):
    """Blocks of a cold medium, named by chained block hash (one subclass per medium)."""

    hashes: list[int]

    def __len__(self) -> int:
        return len(self.hashes)


Buffer = torch.Tensor | bytes | bytearray | memoryview


class ColdMedium(ABC):
    """A keyed block store below host RAM, addressed by chained block hash. Thread-safe.

    What the caller may assume: `contains` does no I/O and changes nothing, so the
    scheduler may call it anywhere, a decode step included. `write_many` and `read_many`
    answer every item with a bool and raise nothing for a failed block (an I/O error, a
    bad checksum, an unreachable server, a block that expired or cannot be decoded):
    that block is a False, counted by the medium. The one exception is
    `ColdContractViolation`, raised by a read from inside a decode step (a programming
    error, counted before it is raised).

    What an implementation must guarantee: a block is either stored whole or not found
    (a torn write is never read back as data); the same (model fingerprint, hash) is
    the same bytes, so writing a block the medium holds is a success without a write;
    reads and writes run only on the transfer worker's threads, and may take as long as
    the medium needs. `healthy` and `reason` feed /health; `writes_enabled` False means
    the manager stops sending blocks here, while reads of stored blocks go on.
    """

    name: ClassVar[str]
    spec: ClassVar[type[KeyedBlocks]]
    healthy: bool
    writes_enabled: bool
    reason: str

    @abstractmethod
    def contains(self, block_hash: int) -> bool:
        """Whether a read of this block may succeed: an index lookup, no I/O."""

    @abstractmethod
    def write_many(self, items: list[tuple[int, Buffer]]) -> list[bool]:
        """Store (hash, payload) pairs, given in prefix order; per item, True when the
        block is stored (or already was). A medium short of room keeps the head of a
        prefix rather than its tail."""

    @abstractmethod
    def read_many(self, items: list[tuple[int, Buffer]]) -> list[bool]:
        """Fill each (hash, out) buffer with the block's payload; per item, True when
        `out` holds the verified payload (on False its contents are unspecified)."""

    @abstractmethod
    def stats(self) -> Any:
        """A stats dataclass (fields declared with tierguard.common.stats counter/gauge)."""

    def close(self) -> None:  # noqa: B027 - optional for media without resources
        """Release files, sockets or threads; the medium is not used afterwards."""


@dataclass
class MediumContext:
    """What every medium is built with, besides its own options."""

    fingerprint: str  # tierguard.kv.spec.fingerprint: names the model and KV layout
    block_bytes: int  # payload bytes of one block
    faults: FaultInjector = field(default_factory=FaultInjector)
    codec: BlockCodec = IDENTITY


MediumFactory = Callable[[MediumContext, Mapping[str, Any]], ColdMedium]

# Media shipped with tierguard, imported on first use: name -> module that registers it.
BUILTIN_MEDIA: dict[str, str] = {"disk": "tierguard.kv.media.disk.tier", "remote": "tierguard.kv.media.remote.tier"}
_REGISTRY: dict[str, MediumFactory] = {}


def register_medium(name: str, factory: MediumFactory) -> None:
    """Make `name` usable in `EngineConfig.kv_media`; called by the medium's module."""
    _REGISTRY[name] = factory


def create_medium(name: str, ctx: MediumContext, options: Mapping[str, Any]) -> ColdMedium:
    """Build a configured medium; TierguardError names an unknown one."""
    if name not in _REGISTRY and name in BUILTIN_MEDIA:
        importlib.import_module(BUILTIN_MEDIA[name])
    if name not in _REGISTRY:
        known = sorted(set(_REGISTRY) | set(BUILTIN_MEDIA))
        raise TierguardError(f"unknown KV medium {name!r}; known: {', '.join(known)}")
    return _REGISTRY[name](ctx, options)
