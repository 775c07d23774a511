"""Device <-> host KV block copy throughput: blocks-first batched copies vs the old layout.

The device KV pool keeps the block index outermost ([blocks, layers, 2, block_size,
kv_heads, head_dim]), so a block is one contiguous slice and a transfer job (one
request's blocks) moves with one gather and one scatter per pool tensor
(`DevicePool.copy_blocks`, what the transfer worker's device <-> host handler runs).
Before, the block index sat at dim 2 ([layers, 2, blocks, ...]) and every block was one
strided copy per pool tensor; that path is reproduced here ("per_block_dim2") on the same
machine, in the same run, so the two are compared as a ratio.

Measured per direction: copy only (the handler's work), and end to end through a real
`TransferWorker` (submit -> worker thread -> get_finished), both on random, non-adjacent
block ids and host slots, as a scheduler hands them out. Prints one JSON object.

    python bench/kv_block_copy.py [--blocks-per-job 64] [--jobs 40] [--device cpu|cuda]

Defaults: the KV of the demo's tiny model (4 layers, 2 KV heads, head_dim 32, float32,
16-token blocks: 32 KiB per block); a 1024-token request is 64 blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tierguard.kv.copy_handlers import register_device_host  # noqa: E402
from tierguard.kv.media import DeviceBlocks, HostSlots  # noqa: E402
from tierguard.kv.media.host import HostTier  # noqa: E402
from tierguard.kv.spec import DevicePool, KVLayout  # noqa: E402
from tierguard.kv.transfer import TransferSpec, TransferWorker  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"], help="int8 adds a scale tensor")
    p.add_argument("--pool-blocks", type=int, default=512)
    p.add_argument("--blocks-per-job", type=int, default=64)
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the engine's copies share cores)")
    return p.parse_args(argv)


def legacy_copy(
    tensors: list[torch.Tensor], offsets, block: int, payload: torch.Tensor, to_device: bool
) -> None:
    """The old path: one strided copy per block per tensor, block index at dim 2."""
    for t, (offset, nbytes) in zip(tensors, offsets, strict=True):
        view = payload[offset : offset + nbytes].view(t.dtype).view(t[:, :, 0].shape)
        if to_device:
            t[:, :, block].copy_(view)
        else:
            view.copy_(t[:, :, block])


def timed(fn, jobs: int, sync) -> float:
    fn(0)  # warm-up
    sync()
    t0 = time.perf_counter()
    for j in range(jobs):
        fn(j)
    sync()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = "int8" if a.kv_dtype == "int8" else a.dtype
    layout = KVLayout(
        a.layers, a.kv_heads, a.head_dim, a.block_size, dtype, "int8" if a.kv_dtype == "int8" else "none"
    )
    device = torch.device(a.device)
    pool = DevicePool.allocate(layout, a.pool_blocks, device)
    for t in pool.tensors:
        t.copy_(torch.randint(-100, 100, t.shape, dtype=torch.int32).to(t.dtype))
    # The old layout: the same tensors with the block index moved to dim 2.
    legacy = [t.movedim(0, 2).contiguous() for t in pool.tensors]
    offsets = pool.part_offsets()
    pin = device.type == "cuda"
    host = HostTier(a.pool_blocks * pool.block_bytes, pool.block_bytes, pin_memory=pin)
    g = torch.Generator().manual_seed(0)
    jobs = [
        (
            torch.randperm(a.pool_blocks, generator=g)[: a.blocks_per_job].tolist(),
            torch.randperm(host.num_slots, generator=g)[: a.blocks_per_job].tolist(),
        )
        for _ in range(a.jobs)
    ]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    moved = a.jobs * a.blocks_per_job * pool.block_bytes
    out: dict = {
        "layout": {**vars(layout), "block_bytes": pool.block_bytes},
        "device": str(device),
        "blocks_per_job": a.blocks_per_job,
        "jobs": a.jobs,
        "torch_threads": a.threads,
        "gb_per_s": {},
    }
    for direction, to_device in (("device_to_host", False), ("host_to_device", True)):
        new_s = timed(
            lambda j, td=to_device: pool.copy_blocks(jobs[j][0], host.slab, jobs[j][1], td), a.jobs, sync
        )

        def old(j: int, td: bool = to_device) -> None:
            for b, s in zip(*jobs[j], strict=True):
                legacy_copy(legacy, offsets, b, host.slab[s], td)

        old_s = timed(old, a.jobs, sync)
        out["gb_per_s"][direction] = {
            "blocks_first_batched": round(moved / new_s / 1e9, 3),
            "per_block_dim2": round(moved / old_s / 1e9, 3),
            "ratio": round(old_s / new_s, 2),
        }
    # End to end through the worker: submit, the worker thread copies, poll until done.
    worker = TransferWorker(pool.block_bytes, num_threads=1)
    register_device_host(worker, pool, host)
    for direction, make in (
        ("device_to_host", lambda j: TransferSpec(DeviceBlocks(jobs[j][0]), HostSlots(jobs[j][1]))),
        ("host_to_device", lambda j: TransferSpec(HostSlots(jobs[j][1]), DeviceBlocks(jobs[j][0]))),
    ):
        t0 = time.perf_counter()
        for j in range(a.jobs):
            worker.transfer_async(j, make(j))
        done = 0
        while done < a.jobs:
            done += len(worker.get_finished())
            time.sleep(0.0002)
        out["gb_per_s"][direction]["worker_end_to_end"] = round(moved / (time.perf_counter() - t0) / 1e9, 3)
    worker.shutdown()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
