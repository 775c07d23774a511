"""Host↔device copy bandwidth, pinned vs pageable, from each NUMA node (CUDA only).

Host buffers are allocated after pinning this thread to the node's CPUs, so first-touch
places them on that node (an approximation of `numactl --membind`, documented as such).
"""

from __future__ import annotations

import os
import time


def copy_bandwidth(numa_nodes: dict[int, list[int]], size_mib: int = 256, repeats: int = 5) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "CUDA not available"}
    results = []
    original = os.sched_getaffinity(0)
    nodes = numa_nodes or {None: sorted(original)}
    dev = torch.device("cuda")
    gpu = torch.empty(size_mib << 20, dtype=torch.uint8, device=dev)
    try:
        for node, cpus in nodes.items():
            usable = set(cpus) & original
            if not usable:
                continue
            os.sched_setaffinity(0, usable)
            for pinned in (True, False):
                host = torch.empty(size_mib << 20, dtype=torch.uint8, pin_memory=pinned)
                host.fill_(1)  # first touch on this node
                row = {"numa_node": node, "pinned": pinned}
                for name, dst, src in (("h2d_gbps", gpu, host), ("d2h_gbps", host, gpu)):
                    dst.copy_(src, non_blocking=pinned)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(repeats):
                        dst.copy_(src, non_blocking=pinned)
                    torch.cuda.synchronize()
                    row[name] = round(repeats * (size_mib << 20) / (time.perf_counter() - t) / 1e9, 2)
                results.append(row)
                del host
    finally:
        os.sched_setaffinity(0, original)
    return {"size_mib": size_mib, "results": results}
