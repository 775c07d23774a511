"""How long the KV tiers take to move blocks, measured with the real tier code.

The simulator never copies bytes; it charges each transfer job (and each synchronous
page-out or page-in of the naive baseline) the time these measurements give:

    route seconds = fixed + per_block x blocks      (per route: device_to_host,
                                                     host_to_device, host_to_disk,
                                                     disk_to_host, naive_spill,
                                                     naive_respill, naive_restore)

The probe uses the classes the engine uses: a CPU `DevicePool` of the variant's KV
layout and a host slab (`DevicePool.copy_blocks`), the disk tier (`DiskTier`, checksums
and fdatasync included) and the naive baseline's spill tier (`NaiveSyncDisk`: blocks
dropped from the page cache after the write, so the read waits for the device), in a
scratch directory on the same file system as the variant's disk tier. `naive_respill`
is a spill of a block the spill tier already holds: the naive pager pages the same
sequence out again and again, and the disk tier writes a block it has only once (its
index names the bytes), so a repeat costs the copy, the directory sync and the page-cache
drop but no file write; it is timed by spilling the same blocks a second time. A medium
with no measurement (e.g. the remote tier) is charged the disk's times and listed in
`uncalibrated`.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierguard.kv.spec import KVLayout

ROUTES = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host", "naive_spill", "naive_respill",
          "naive_restore")
PROBE_SIZES = (1, 8)  # blocks per job: two sizes separate the fixed cost from the per-block cost
PROBE_REPEATS = 5


@dataclass
class RouteCost:
    fixed_s: float
    per_block_s: float

    def seconds(self, blocks: int) -> float:
        return self.fixed_s + self.per_block_s * max(0, blocks)


@dataclass
class MediaCost:
    routes: dict[str, RouteCost]
    block_bytes: int
    uncalibrated: list[str] = field(default_factory=list)

    def route(self, name: str) -> RouteCost:
        """A route's cost; a cold medium without its own measurement is charged the disk's,
        a naive repeat spill without one the first spill's."""
        if name in self.routes:
            return self.routes[name]
        if name == "naive_respill":
            return self.route("naive_spill")
        src, _, dst = name.partition("_to_")
        proxy = f"{'disk' if src not in ('device', 'host') else src}_to_{'disk' if dst not in ('device', 'host') else dst}"
        if name not in self.uncalibrated:
            self.uncalibrated.append(name)
        return self.routes.get(proxy, RouteCost(0.0, 0.0))

    def to_json(self) -> dict:
        return {
            "block_bytes": self.block_bytes,
            "routes": {k: {"fixed_ms": v.fixed_s * 1e3, "per_block_ms": v.per_block_s * 1e3} for k, v in self.routes.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> MediaCost:
        routes = {k: RouteCost(v["fixed_ms"] / 1e3, v["per_block_ms"] / 1e3) for k, v in d["routes"].items()}
        return cls(routes, int(d["block_bytes"]))


def _fit(samples: dict[int, list[float]]) -> RouteCost:
    """fixed + per_block from the median time at each probe size (never negative)."""
    (n1, t1), (n2, t2) = sorted((n, statistics.median(ts)) for n, ts in samples.items())
    per = max(0.0, (t2 - t1) / (n2 - n1))
    return RouteCost(max(0.0, t1 - per * n1), per)


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _each(fn, keys: list[int]) -> None:
    for i, k in enumerate(keys):
        fn(k, i)


def measure_media(layout: KVLayout, scratch_parent: str | Path | None = None) -> MediaCost:
    """Time every route on this machine for one KV layout (about a second)."""
    import torch

    from tierguard.baselines.naive_kv import NaiveSpillTier, NaiveSyncDisk
    from tierguard.kv.media.disk.tier import DiskTier
    from tierguard.kv.spec import DevicePool

    nmax = max(PROBE_SIZES)
    pool = DevicePool.allocate(layout, nmax + 1, "cpu")
    for t in pool.tensors:
        t.view(torch.uint8).random_(0, 255)
    bb = pool.block_bytes
    slab = torch.zeros((nmax, bb), dtype=torch.uint8)
    parent = Path(scratch_parent) if scratch_parent else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tierguard-media-", dir=parent))
    fp = "0123456789abcdef"
    samples: dict[str, dict[int, list[float]]] = {r: {n: [] for n in PROBE_SIZES} for r in ROUTES}
    rng = np.random.default_rng(0)
    try:
        disk = DiskTier(root / "disk", fp, 1 << 34)
        naive = NaiveSyncDisk(pool, NaiveSpillTier(root / "naive", fp, 1 << 34))
        for rep in range(PROBE_REPEATS + 1):  # the first round warms caches up and is not kept
            for n in PROBE_SIZES:
                ids, slots = list(range(n)), list(range(n))
                samples["device_to_host"][n].append(_timed(pool.copy_blocks, ids, slab, slots, False))
                samples["host_to_device"][n].append(_timed(pool.copy_blocks, ids, slab, slots, True))
                keys = [int(k) for k in rng.integers(1, 1 << 62, size=n)]
                items = [(k, slab[i]) for i, k in enumerate(keys)]
                samples["host_to_disk"][n].append(_timed(disk.write_many, items))
                samples["disk_to_host"][n].append(_timed(disk.read_many, items))
                nkeys = [int(k) for k in rng.integers(1, 1 << 62, size=n)]
                samples["naive_spill"][n].append(_timed(_each, naive.spill, nkeys))
                samples["naive_respill"][n].append(_timed(_each, naive.spill, nkeys))
                samples["naive_restore"][n].append(_timed(_each, naive.restore, nkeys))
            if rep == 0:
                samples = {r: {n: [] for n in PROBE_SIZES} for r in ROUTES}
        disk.close()
        naive.disk.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return MediaCost({r: _fit(s) for r, s in samples.items()}, bb)
