"""Adding a medium is one module plus registration: an in-memory cold medium, defined here,
configured by name, serves a prefix after a restart with no engine code aware of it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from tests.engine.conftest import make_engine
from tests.engine.test_tiers import PROMPTS, run
from tierguard.common.errors import TierguardError
from tierguard.common.stats import counter, gauge
from tierguard.kv.media import ColdMedium, KeyedBlocks, MediumContext, register_medium
from tierguard.kv.media.disk.format import as_buffer


@dataclass
class MemoryBlocks(KeyedBlocks):
    medium = "memory"


@dataclass
class MemoryStats:
    blocks: int = gauge("Blocks held.")
    reads: int = counter("Blocks read.")


class MemoryMedium(ColdMedium):
    """A dict shared through the options (so a second engine sees the first one's blocks)."""

    name = "memory"
    spec = MemoryBlocks

    def __init__(self, ctx: MediumContext, options) -> None:
        self.store: dict[tuple[str, int], bytes] = options["store"]
        self.fingerprint = ctx.fingerprint
        self.healthy, self.writes_enabled, self.reason = True, True, ""
        self.reads = 0
        self.lock = threading.Lock()

    def contains(self, block_hash: int) -> bool:
        return (self.fingerprint, block_hash) in self.store

    def write_many(self, items) -> list[bool]:
        for h, payload in items:
            self.store[self.fingerprint, h] = bytes(as_buffer(payload))
        return [True] * len(items)

    def read_many(self, items) -> list[bool]:
        out = []
        for h, dst in items:
            data = self.store.get((self.fingerprint, h))
            if data is not None:
                as_buffer(dst)[:] = data
                with self.lock:
                    self.reads += 1
            out.append(data is not None)
        return out

    def stats(self) -> MemoryStats:
        return MemoryStats(len(self.store), self.reads)


register_medium("memory", MemoryMedium)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return run(make_engine(tiny_dir), PROMPTS[:2])


def test_a_registered_medium_serves_a_prefix_after_restart(tiny_dir, reference):
    store: dict = {}
    media = {"memory": {"store": store}}
    first = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=media)
    assert run(first, PROMPTS[:2]) == reference
    first.close()  # write-behind finishes here
    assert first.stats().flat()["kv_persisted_blocks"] == len(store) > 0
    second = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=media)  # empty host RAM
    try:
        assert run(second, PROMPTS[:2]) == reference
        x = second.stats().flat()
        assert x["kv_memory_hits"] > 0 and x["kv_blocks_loaded_from_memory"] == x["kv_memory_hits"]
        assert x["kv_memory_reads"] == x["kv_memory_hits"] and x["kv_transfer_memory_to_host_jobs"] > 0
    finally:
        second.close()


def test_an_unknown_medium_is_one_clear_error(tiny_dir):
    with pytest.raises(TierguardError, match="unknown KV medium 'tape'"):
        make_engine(tiny_dir, kv_media={"tape": {}})
