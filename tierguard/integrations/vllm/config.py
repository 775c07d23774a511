"""`kv_connector_extra_config` of the vLLM connector: `tierguard serve`'s tier flags in snake
case, plus the load deadlines and the store queue.

    {"kv_host_gib": 4, "kv_disk_dir": "/nvme/kv", "kv_disk_gib": 100,
     "kv_remote_url": "redis://10.0.0.5:6379/0", "kv_encrypt_key_file": "/etc/tg/kv.key",
     "load_deadline_ms": {"interactive": 500, "batch": 15000}}

Validation is serve's own (tierguard/serve/tier_flags.py), so a value `tierguard serve`
refuses is refused here with the same reason, naming the option as the user wrote it.
Beyond it: every number must be finite (JSON configs can say "nan" or "inf"), the
directories must be writable by the process now (not at the first store, mid-run), and
the connector's own counts have bounds (`BOUNDS`, docs/vllm-connector.md).
Only this file knows the option names; nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierguard.common.errors import TierguardError
from tierguard.kv.contract import BATCH, INTERACTIVE, REQUEST_CLASSES, ColdContract, parse_ttft_budgets
from tierguard.serve.tier_flags import tier_kwargs

GIB = 1 << 30

# Serve's flags (snake case) and their defaults there, except two: kv_host_gib is the
# staging area too, so the connector needs it positive and gives it a default; and the
# Redis timeout (below).
_SERVE_OPTIONS: dict[str, Any] = {
    "kv_host_gib": 1.0,
    "kv_disk_dir": None,
    "kv_disk_gib": 0.0,
    "kv_disk_ttl_s": 0.0,
    "kv_remote_url": None,
    "kv_remote_ttl_s": 3600.0,
    "kv_remote_gib": 1.0,
    # vLLM's blocks are large (128 tokens: about 3 MB for a 135M model, 16 MB for an 8B one),
    # so a Redis round trip carrying them needs more than serve's 50 ms.
    "kv_remote_timeout_ms": 500.0,
    "kv_encrypt_key_file": None,
    "kv_encrypt_old_key_file": None,
    "ttft_budget_ms": None,
}
_OWN_OPTIONS: dict[str, Any] = {
    "load_deadline_ms": None,  # per class; default: the staging share of the class's TTFT budget
    "default_class": INTERACTIVE,
    "store_queue_blocks": 256,  # blocks whose copy out is queued or running; past it a store is dropped
    "transfer_threads": 2,
    "metrics_port": 0,  # side endpoint with tierguard's metric names; 0: off
    "metrics_host": "127.0.0.1",
    "host_shm_dir": "/dev/shm",  # where the host slab both vLLM processes map lives
    "fault_file": None,  # tests and benchmarks only: a JSON file of faults to arm (faults.py)
}
OPTIONS = {**_SERVE_OPTIONS, **_OWN_OPTIONS}
# (least, most) for the connector's own counts: past them a value is a typo, not a plan
# (each transfer thread is an OS thread; each queued store pins a host-RAM slot)
BOUNDS = {"transfer_threads": (1, 64), "store_queue_blocks": (1, 65536), "metrics_port": (0, 65535)}
_FLAG = re.compile(r"--([a-z0-9]+(?:-[a-z0-9]+)*)")


@dataclass
class ConnectorConfig:
    host_bytes: int
    media: dict[str, dict[str, Any]] = field(default_factory=dict)  # lookup order: disk, then remote
    encrypt_key_file: str | None = None
    encrypt_old_key_file: str | None = None
    ttft_budget_ms: dict[str, float] | None = None
    load_deadline_ms: dict[str, float] = field(default_factory=dict)
    default_class: str = INTERACTIVE
    store_queue_blocks: int = 256
    transfer_threads: int = 2
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    host_shm_dir: str = "/dev/shm"
    fault_file: str | None = None

    def codec(self):
        """The BlockCodec cold media store blocks with (AES-256-GCM with a key file)."""
        if not self.encrypt_key_file:
            from tierguard.kv.media.block_format import IDENTITY

            return IDENTITY
        from tierguard.kv.media.aead_codec import AesGcmCodec

        old = [self.encrypt_old_key_file] if self.encrypt_old_key_file else []
        return AesGcmCodec.from_files(self.encrypt_key_file, old)


def _snake(message: str) -> str:
    """Serve's messages name flags (--kv-disk-dir); here the user wrote kv_disk_dir."""
    return _FLAG.sub(lambda m: m.group(1).replace("-", "_"), message)


def parse_deadlines(value: Any, contract: ColdContract) -> dict[str, float]:
    """`load_deadline_ms`: a number (interactive), "interactive=500,batch=15000", or a mapping.
    Classes not given get the staging share of their TTFT budget (the contract's deadline);
    batch never less than interactive."""
    out = {c: contract.staging_deadline(c, 0.0) * 1000.0 for c in REQUEST_CLASSES}
    if value is None:
        return out
    if isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, int | float) and not isinstance(value, bool):
        items = [(INTERACTIVE, value)]
    else:
        items = []
        for part in (p.strip() for p in str(value).split(",") if p.strip()):
            name, sep, ms = part.rpartition("=")
            items.append((name.strip() if sep else INTERACTIVE, ms))
    for name, ms in items:
        cls = name.lower()
        if cls not in REQUEST_CLASSES:
            raise TierguardError(
                f"load_deadline_ms: unknown request class {name!r}; expected {REQUEST_CLASSES}"
            )
        try:
            number = float(ms)
        except (TypeError, ValueError):
            raise TierguardError(f"load_deadline_ms: {ms!r} is not a number of milliseconds") from None
        if not 0 < number < float("inf"):
            raise TierguardError(f"load_deadline_ms: the {cls} deadline must be positive, got {ms!r}")
        out[cls] = number
    if BATCH not in {n.lower() for n, _ in items}:  # batch is never given less time than interactive
        out[BATCH] = max(out[BATCH], out[INTERACTIVE])
    if out[BATCH] < out[INTERACTIVE]:
        raise TierguardError(
            f"load_deadline_ms: batch ({out[BATCH]:g} ms) may not be shorter than interactive "
            f"({out[INTERACTIVE]:g} ms)"
        )
    return out


def _bounded_int(options: Mapping[str, Any], name: str) -> int:
    value = options[name]
    least, most = BOUNDS[name]
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or int(value) != value
        or value < least
    ):
        raise TierguardError(f"{name} must be an integer >= {least}, got {value!r}")
    if value > most:
        raise TierguardError(f"{name} must be at most {most}, got {value!r}")
    return int(value)


def _number(options: Mapping[str, Any], name: str) -> float:
    """A finite float from a number or a numeric string, or a TierguardError naming `name`."""
    value = options[name]
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise TierguardError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise TierguardError(f"{name} must be a finite number, got {value!r}")
    return number


def _writable_dir(name: str, path: str) -> None:
    """`path` is (made, if missing) a directory this process can create files in: refused
    now, naming the option, rather than at the first store, mid-run. The probe is a real
    file, so a read-only mount is caught even for root, whom permission bits do not stop."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tierguard-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TierguardError(f"{name} {path!r} is not a writable directory: {e.strerror or e}") from None


def parse_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """The connector's settings from `kv_connector_extra_config`; TierguardError names a bad one."""
    given = dict(extra or {})
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise TierguardError(
            f"kv_connector_extra_config: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(OPTIONS))}"
        )
    options = {**OPTIONS, **{k: v for k, v in given.items() if v is not None}}
    budgets = options["ttft_budget_ms"]
    if isinstance(budgets, Mapping):
        options["ttft_budget_ms"] = ",".join(f"{k}={v}" for k, v in budgets.items())
    elif budgets is not None:
        options["ttft_budget_ms"] = str(budgets)
    for name in ("kv_host_gib", "kv_disk_gib", "kv_disk_ttl_s", "kv_remote_ttl_s", "kv_remote_gib",
                 "kv_remote_timeout_ms"):
        options[name] = _number(options, name)
    if options["kv_host_gib"] <= 0:
        raise TierguardError(
            "kv_host_gib must be positive: host RAM is the connector's staging area and its first tier"
        )
    try:
        kw = tier_kwargs(
            argparse.Namespace(**{k: options[k] for k in _SERVE_OPTIONS}, kv_naive_sync_disk=False)
        )
    except TierguardError as e:
        raise TierguardError(_snake(str(e))) from None
    media: dict[str, dict[str, Any]] = {}
    if kw["kv_disk_dir"] is not None:
        _writable_dir("kv_disk_dir", str(kw["kv_disk_dir"]))
        media["disk"] = {"dir": kw["kv_disk_dir"], "capacity_bytes": int(kw["kv_disk_gib"] * GIB)}
        if kw.get("kv_disk_ttl_s"):
            media["disk"]["ttl_s"] = kw["kv_disk_ttl_s"]
    media.update(kw.get("kv_media", {}))
    budgets_ms = parse_ttft_budgets(options["ttft_budget_ms"]) if options["ttft_budget_ms"] else None
    default_class = str(options["default_class"]).lower()
    if default_class not in REQUEST_CLASSES:
        raise TierguardError(
            f"default_class must be one of {REQUEST_CLASSES}, got {options['default_class']!r}"
        )
    port = _bounded_int(options, "metrics_port")
    _writable_dir("host_shm_dir", str(options["host_shm_dir"]))
    return ConnectorConfig(
        host_bytes=int(kw["kv_host_gib"] * GIB),
        media=media,
        encrypt_key_file=kw.get("kv_encrypt_key_file"),
        encrypt_old_key_file=kw.get("kv_encrypt_old_key_file"),
        ttft_budget_ms=budgets_ms,
        load_deadline_ms=parse_deadlines(options["load_deadline_ms"], ColdContract(budgets_ms)),
        default_class=default_class,
        store_queue_blocks=_bounded_int(options, "store_queue_blocks"),
        transfer_threads=_bounded_int(options, "transfer_threads"),
        metrics_port=port,
        metrics_host=str(options["metrics_host"]),
        host_shm_dir=str(options["host_shm_dir"]),
        fault_file=str(options["fault_file"]) if options["fault_file"] else None,
    )
