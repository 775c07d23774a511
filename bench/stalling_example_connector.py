"""vLLM's `ExampleConnector` with the fault hook tierguard's disk tier has, for the
comparison in bench/vllm_connector_vs_example.py.

ExampleConnector reads its safetensors files inside `start_load_kv`, on the worker's
forward thread. This subclass changes nothing about that; it only lets a benchmark delay
those reads the way tierguard's `fault_file` delays a disk read (a stalled NVMe, a hung
network mount): the same JSON rules (`[{"op": "disk.read", "delay_s": 30, "times": 1}]`),
re-read whenever the file named by `fault_file` in the extra config changes.

    "kv_connector": "StallingExampleConnector",
    "kv_connector_module_path": "stalling_example_connector"   (bench/ on PYTHONPATH)
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import safetensors.torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

_load_file = safetensors.torch.load_file


class StallingExampleConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fault_file = self._kv_transfer_config.get_from_extra_config("fault_file", None)
        self._stamp: tuple[float, int] | None = None
        self._delays: list[float] = []

    def _arm(self) -> None:
        try:
            st = os.stat(self._fault_file)
        except (OSError, TypeError):
            return
        if (st.st_mtime, st.st_size) == self._stamp:
            return
        self._stamp = (st.st_mtime, st.st_size)
        try:
            with open(self._fault_file) as f:
                rules = json.load(f)
        except (OSError, ValueError):
            return
        self._delays = [
            float(r["delay_s"]) for r in rules if r.get("op") == "disk.read" and "delay_s" in r
            for _ in range(int(r.get("times", 1)))
        ]  # fmt: skip

    def _load(self, filename: str, *args: Any, **kwargs: Any):
        if self._delays:
            time.sleep(self._delays.pop(0))
        return _load_file(filename, *args, **kwargs)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._arm()
        safetensors.torch.load_file = self._load
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            safetensors.torch.load_file = _load_file
