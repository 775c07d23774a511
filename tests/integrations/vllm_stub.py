"""The few names tierguard/integrations/vllm/connector.py imports from vLLM, so the
default suite can import and drive it where vLLM is not installed.

Only the base class's state is reproduced (vLLM's `KVConnectorBase_V1.__init__` keeps the
config, the transfer config, the role; `bind_connector_metadata` and
`clear_connector_metadata` set and clear `_connector_metadata`), plus the enums and the
attention spec the connector reads. Everything behind them is tierguard's own: the real
scheduler and worker sides, real media, a real shared slab. The same connector inside a
real vLLM is tests/integrations/test_vllm_real.py (slow, `.venv-vllm`).
"""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    pass


class KVConnectorWorkerMetadata:
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        raise NotImplementedError


class KVConnectorBase_V1:  # noqa: N801  (vLLM's name)
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None


class CacheHitSource(enum.Enum):
    DEVICE = "device"
    DISK = "disk"


@dataclass
class AttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    page_size_bytes: int
    sliding_window: int | None = None


def _module(name: str, **names: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(names)
    return m


MODULES = {
    "vllm": {},
    "vllm.distributed": {},
    "vllm.distributed.kv_transfer": {},
    "vllm.distributed.kv_transfer.kv_connector": {},
    "vllm.distributed.kv_transfer.kv_connector.v1": {},
    "vllm.distributed.kv_transfer.kv_connector.v1.base": {
        "KVConnectorBase_V1": KVConnectorBase_V1,
        "KVConnectorMetadata": KVConnectorMetadata,
        "KVConnectorRole": KVConnectorRole,
        "KVConnectorWorkerMetadata": KVConnectorWorkerMetadata,
    },
    "vllm.v1": {},
    "vllm.v1.metrics": {},
    "vllm.v1.metrics.cache_hit_source": {"CacheHitSource": CacheHitSource},
    "vllm.v1.kv_cache_interface": {"AttentionSpec": AttentionSpec},
}
CONNECTOR = "tierguard.integrations.vllm.connector"


def install(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Put the stand-ins in sys.modules (for this test only) and import connector.py anew."""
    for name, names in MODULES.items():
        monkeypatch.setitem(sys.modules, name, _module(name, **names))
    sys.modules.pop(CONNECTOR, None)
    import tierguard.integrations.vllm.connector as connector

    return connector


def uninstall() -> None:
    """Forget the connector imported against the stand-ins (monkeypatch restores the rest)."""
    sys.modules.pop(CONNECTOR, None)
