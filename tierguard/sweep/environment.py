"""The environment and topology of the machine that ran a sweep (R11, R12).

Each bench run records its own environment in run.json; this is the sweep-level copy
the report shows once: host, Python, CPU, RAM, GPUs, and the topology tools' output
when they exist (`nvidia-smi topo -m`, `numactl --hardware`, `lspci -tv`).
"""

from __future__ import annotations

import os
import platform
import sys
import time

from tierguard.bench.topo import run_tool

TOPOLOGY_COMMANDS = {
    "nvidia_smi": ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pci.bus_id", "--format=csv"],
    "nvidia_smi_topo": ["nvidia-smi", "topo", "-m"],
    "numactl_hardware": ["numactl", "--hardware"],
    "lspci_tree": ["lspci", "-tv"],
}


def capture_environment() -> dict:
    from tierguard import __version__

    try:
        import psutil

        ram = psutil.virtual_memory().total
    except ImportError:
        ram = None
    env = {
        "captured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tierguard": __version__,
        "python": sys.version.split()[0],
        "os": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "host_ram_bytes": ram,
        "topology": {},
    }
    for name, argv in TOPOLOGY_COMMANDS.items():
        out = run_tool(argv, timeout=10.0)
        if out is not None:
            env["topology"][name] = out.strip()
    return env
