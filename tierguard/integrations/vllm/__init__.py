"""tierguard's KV tiers and cold contract inside vLLM: `TierguardConnector`.

What a vLLM user names in `--kv-transfer-config` ("kv_connector": "TierguardConnector",
"kv_connector_module_path": "tierguard.integrations.vllm"); see docs/vllm-connector.md.

connector.py   the KVConnectorBase_V1 class: vLLM's objects in, plain values out
config.py      kv_connector_extra_config: serve's tier flags in snake case, deadlines
layout.py      block geometry of vLLM's KV cache, the fingerprint, the block hashes
scheduler.py   scheduler side: tiers, index lookups, load deadlines, stores, backpressure
worker.py      worker side: copies between vLLM's KV cache and the shared host slab
ops.py         what crosses between the two sides each step
shm.py         the host slab both vLLM processes map
stats.py       metrics with tierguard's names, on a side endpoint
faults.py      fault injection into a running server (tests and benchmarks only)

Only connector.py imports vLLM, and only when `TierguardConnector` is first used, so
the rest runs (and is tested) without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierguardConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierguardConnector":
        from tierguard.integrations.vllm.connector import TierguardConnector

        return TierguardConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
