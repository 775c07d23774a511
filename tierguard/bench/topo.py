"""Host topology (R12): which NUMA node each GPU and NVMe hangs off, how its PCIe link
is running, and where this process is allowed to run and allocate.

Everything is read from sysfs/procfs and a few tools when present (`nvidia-smi`,
`numactl`, `lspci`); what cannot be read is listed under `missing` instead of failing,
so the same capture works on a laptop, a CI box and a GPU server.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

SYS_PCI = Path("/sys/bus/pci/devices")
GPU_VENDORS = {"0x10de": "NVIDIA", "0x1002": "AMD", "0x8086": "Intel"}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def run_tool(args: list[str], timeout: float = 15.0) -> str | None:
    """Output of a tool, or None when it is absent or fails."""
    if shutil.which(args[0]) is None:
        return None
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def parse_cpulist(text: str | None) -> list[int]:
    """"0-3,8,10-11" → [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def pci_link(dev: Path) -> dict:
    def speed(name: str) -> float | None:
        m = re.match(r"([\d.]+)\s*GT/s", _read(dev / name) or "")
        return float(m.group(1)) if m else None

    def width(name: str) -> int | None:
        v = _read(dev / name)
        return int(v) if v and v.isdigit() else None

    numa = _read(dev / "numa_node")
    link = {
        "numa_node": int(numa) if numa not in (None, "-1") else None,  # sysfs -1: no affinity known
        "link_speed_gts": speed("current_link_speed"), "max_link_speed_gts": speed("max_link_speed"),
        "link_width": width("current_link_width"), "max_link_width": width("max_link_width"),
    }
    gen = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
    link["pcie_gen"] = gen.get(link["link_speed_gts"] or 0.0)
    link["max_pcie_gen"] = gen.get(link["max_link_speed_gts"] or 0.0)
    return link


def gpus() -> list[dict]:
    out = []
    smi = run_tool(["nvidia-smi", "--query-gpu=index,name,pci.bus_id,driver_version,memory.total",
                    "--format=csv,noheader"])
    if smi:
        for line in smi.strip().splitlines():
            idx, name, bus, driver, mem = [x.strip() for x in line.split(",")]
            bus = bus.lower()
            bus = bus[4:] if len(bus.split(":")[0]) == 8 else bus  # 00000000:3b:00.0 → 0000:3b:00.0
            out.append({"index": int(idx), "name": name, "pci_bus_id": bus, "driver": driver, "memory": mem,
                        **pci_link(SYS_PCI / bus)})
        return out
    if SYS_PCI.is_dir():
        for dev in sorted(SYS_PCI.iterdir()):
            cls = _read(dev / "class") or ""
            vendor = _read(dev / "vendor") or ""
            if cls.startswith(("0x0300", "0x0302", "0x0380")) and vendor in GPU_VENDORS:
                out.append({"index": len(out), "name": f"{GPU_VENDORS[vendor]} {_read(dev / 'device')}",
                            "pci_bus_id": dev.name, **pci_link(dev)})
    return out


def nvme_devices() -> list[dict]:
    out = []
    base = Path("/sys/class/nvme")
    if base.is_dir():
        for ctrl in sorted(base.iterdir()):
            dev = (ctrl / "device").resolve()
            out.append({"name": ctrl.name, "model": _read(ctrl / "model"), "pci_bus_id": dev.name, **pci_link(dev)})
    return out


def numa_nodes() -> dict[int, list[int]]:
    base = Path("/sys/devices/system/node")
    nodes = {}
    if base.is_dir():
        for d in sorted(base.glob("node[0-9]*")):
            nodes[int(d.name[4:])] = parse_cpulist(_read(d / "cpulist"))
    return nodes


def binding() -> dict:
    status = _read(Path("/proc/self/status")) or ""
    mems = re.search(r"^Mems_allowed_list:\s*(\S+)", status, re.M)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {"cpus": cpus, "mems_allowed": parse_cpulist(mems.group(1)) if mems else None}


def mismatches(topo: dict) -> list[str]:
    flags = []
    nodes, bind = topo["numa_nodes"], topo["binding"]
    cpu_nodes = sorted({n for n, cpus in nodes.items() if set(cpus) & set(bind["cpus"])})
    for dev in topo["gpus"] + topo["nvme"]:
        label = f"GPU {dev['index']}" if "index" in dev else dev["name"]
        if dev.get("numa_node") is not None and len(nodes) > 1:
            if dev["numa_node"] not in cpu_nodes:
                flags.append(f"{label} is on NUMA node {dev['numa_node']} but this process runs on node(s) {cpu_nodes}")
            if bind["mems_allowed"] is not None and dev["numa_node"] not in bind["mems_allowed"]:
                flags.append(f"{label} is on NUMA node {dev['numa_node']} but memory is bound to {bind['mems_allowed']}")
        if dev.get("link_width") and dev.get("max_link_width") and dev["link_width"] < dev["max_link_width"]:
            flags.append(f"{label} PCIe link x{dev['link_width']} below its maximum x{dev['max_link_width']}")
        if dev.get("pcie_gen") and dev.get("max_pcie_gen") and dev["pcie_gen"] < dev["max_pcie_gen"]:
            flags.append(f"{label} PCIe gen{dev['pcie_gen']} below its maximum gen{dev['max_pcie_gen']} "
                         "(GPUs drop the link speed when idle: re-check under load)")
    return flags


def captures() -> dict[str, str | None]:
    return {"nvidia-smi topo -m": run_tool(["nvidia-smi", "topo", "-m"]),
            "numactl --hardware": run_tool(["numactl", "--hardware"]),
            "lspci -tv": run_tool(["lspci", "-tv"])}


def collect(with_captures: bool = True) -> dict:
    topo = {"gpus": gpus(), "nvme": nvme_devices(), "numa_nodes": numa_nodes(), "binding": binding()}
    topo["mismatches"] = mismatches(topo)
    topo["captures"] = captures() if with_captures else {}
    missing = [k for k, v in topo["captures"].items() if v is None]
    if not topo["gpus"]:
        missing.append("no GPU found (nvidia-smi absent and no GPU in /sys/bus/pci)")
    if not topo["nvme"]:
        missing.append("no NVMe controller in /sys/class/nvme")
    if not topo["numa_nodes"]:
        missing.append("no NUMA information in /sys/devices/system/node")
    topo["missing"] = missing
    return topo
