"""`tierguard topo`: GPUs, NVMe and this process's binding by NUMA node; PCIe links; mismatches."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("topo", help="host topology: NUMA, PCIe links, bindings, copy bandwidth",
                              description=__doc__)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--output", default=None, metavar="FILE", help="also save the JSON here")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the CUDA copy bandwidth test")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="buffer size of the bandwidth test")
    return p


def _render(t: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    b = t["binding"]
    c.print("[bold]NUMA nodes[/]: " + ", ".join(f"{n}: cpus {len(cpus)}" for n, cpus in t["numa_nodes"].items())
            if t["numa_nodes"] else "[bold]NUMA nodes[/]: unknown")
    c.print(f"[bold]process binding[/]: cpus {b['cpus']}  mems {b['mems_allowed']}")
    for title, rows in (("GPUs", t["gpus"]), ("NVMe", t["nvme"])):
        if not rows:
            continue
        tab = Table(title=title)
        for col in ("device", "bus", "NUMA", "PCIe gen (max)", "width (max)"):
            tab.add_column(col)
        for d in rows:
            tab.add_row(str(d.get("name")), d.get("pci_bus_id", "?"), str(d.get("numa_node")),
                        f"{d.get('pcie_gen')} ({d.get('max_pcie_gen')})", f"x{d.get('link_width')} (x{d.get('max_link_width')})")
        c.print(tab)
    bw = t.get("bandwidth") or {}
    for row in bw.get("results", []):
        c.print(f"node {row['numa_node']} {'pinned  ' if row['pinned'] else 'pageable'}  "
                f"H2D {row['h2d_gbps']} GB/s  D2H {row['d2h_gbps']} GB/s")
    if bw.get("skipped"):
        c.print(f"bandwidth test skipped: {bw['skipped']}")
    for flag in t["mismatches"]:
        c.print(f"[bold yellow]MISMATCH[/] {flag}")
    if not t["mismatches"]:
        c.print("no mismatches found")
    for m in t["missing"]:
        c.print(f"[dim]missing: {m}[/]")


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from tierguard.bench import topo
    from tierguard.common.errors import TierguardError

    t = topo.collect(with_captures=True)
    if args.no_bandwidth:
        t["bandwidth"] = {"skipped": "--no-bandwidth"}
    else:
        try:
            from tierguard.bench.bandwidth import copy_bandwidth

            t["bandwidth"] = copy_bandwidth(t["numa_nodes"], args.bandwidth_mib)
        except ImportError:
            t["bandwidth"] = {"skipped": "torch not installed"}
        except RuntimeError as exc:  # CUDA errors surface as RuntimeError
            t["bandwidth"] = {"skipped": f"CUDA error: {exc}"}
    text = json.dumps(t, indent=2)
    if args.output:
        try:
            Path(args.output).write_text(text + "\n")
        except OSError as exc:
            raise TierguardError(f"--output {args.output}: {exc.strerror}") from None
    if args.json:
        print(text)
    else:
        _render(t)
    return 0
