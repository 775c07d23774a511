"""The environment a run happened in (R11, R12): enough to tell two runs apart later.

tierguard/Python/OS/CPU/RAM, GPU/driver/CUDA from `nvidia-smi` when present, the
engine's own version (`/version`, else `/v1/models`) and the topology captures.
"""

from __future__ import annotations

import json
import platform
import re
import sys
import urllib.request
from pathlib import Path

import psutil

from tierguard import __version__
from tierguard.bench import topo


def _cpu_model() -> str:
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        return m.group(1).strip() if m else platform.processor()
    except OSError:
        return platform.processor()


def _get_json(url: str, headers: dict[str, str]) -> dict | None:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def engine_info(base_url: str, headers: dict[str, str]) -> dict:
    base = base_url.rstrip("/")
    version = _get_json(base + "/version", headers)
    models = _get_json(base + "/v1/models", headers)
    info: dict = {}
    if isinstance(version, dict):
        info["version"] = version.get("version", version)
    if isinstance(models, dict) and isinstance(models.get("data"), list):
        info["models"] = [{k: m.get(k) for k in ("id", "owned_by", "root", "max_model_len") if k in m}
                          for m in models["data"] if isinstance(m, dict)]
    return info


def gpu_info() -> dict | None:
    out = topo.run_tool(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if not out:
        return None
    head = topo.run_tool(["nvidia-smi"]) or ""
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", head)
    return {"gpus": [line.strip() for line in out.strip().splitlines()],
            "cuda_version": cuda.group(1) if cuda else None}


def collect_environment(base_url: str, headers: dict[str, str], event_loop: str) -> dict:
    return {
        "tierguard": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": psutil.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "event_loop": event_loop,
        "gpu": gpu_info(),
        "engine": engine_info(base_url, headers),
        "topology": topo.collect(with_captures=True),
    }
