"""Shared helpers for the KV tier tests: tiny layouts, deterministic payloads, polling."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from tierguard.kv.spec import KVLayout, fingerprint

FP = "0123456789abcdef"


def payload(block_hash: int, nbytes: int) -> torch.Tensor:
    """Deterministic bytes for a block, so a reader can tell whose bytes it got."""
    g = torch.Generator().manual_seed(block_hash % (2**63))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


@pytest.fixture
def fp(layout: KVLayout) -> str:
    return fingerprint("tiny-test-model", layout)
