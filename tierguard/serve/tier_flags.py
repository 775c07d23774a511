"""`tierguard serve` flags of the tiered KV store and the cold contract.

Kept out of cli/serve.py so that file stays small; imports nothing heavy (no torch), as
the CLI requires. Validation happens here, before the model loads.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from urllib.parse import urlsplit

from tierguard.common.errors import TierguardError
from tierguard.common.redact import redact_url


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tiered KV store (host RAM, NVMe, a shared Redis) and the cold contract")
    g.add_argument(
        "--kv-host-gib",
        type=float,
        default=0.0,
        help="host-RAM KV tier budget: evicted prefix blocks and preempted sequences (default 0: off)",
    )
    g.add_argument(
        "--kv-disk-dir", default=None, help="NVMe KV tier directory (prefix blocks only; survives restarts)"
    )
    g.add_argument("--kv-disk-gib", type=float, default=0.0, help="NVMe KV tier budget (needs --kv-disk-dir)")
    g.add_argument(
        "--kv-remote-url",
        default=None,
        help="shared remote KV tier on Redis, redis://[[USER]:PASSWORD@]HOST:PORT[/DB] (one node; rediss:// "
        "for TLS) or redis+cluster://HOST:PORT[,HOST:PORT...] (a Redis Cluster, seeded by any of its nodes; "
        "docs/fleet.md): full "
        "prefix blocks are written behind the answer and read by every replica naming the same Redis "
        "(needs --kv-host-gib)",
    )
    g.add_argument(
        "--kv-remote-ttl-s",
        type=float,
        default=3600.0,
        help="remote blocks expire this long after their write",
    )
    g.add_argument(
        "--kv-remote-gib",
        type=float,
        default=1.0,
        help="remote tier budget as this replica counts it (give every replica the same); past it the "
        "least recently used blocks are deleted. Redis' own maxmemory bounds it too",
    )
    g.add_argument(
        "--kv-remote-timeout-ms",
        type=float,
        default=50.0,
        help="Redis connect and command timeout; past it the call is a miss (recomputed)",
    )
    g.add_argument(
        "--ttft-budget-ms",
        default=None,
        help="TTFT budget per request class, e.g. 'interactive=1000,batch=30000'; staging from "
        "disk gets half of it, then interactive recomputes and batch keeps waiting",
    )
    g.add_argument(
        "--kv-encrypt-key-file",
        default=None,
        metavar="PATH",
        help="AES-256-GCM key (32 bytes: raw, hex or base64; mode 0600) sealing every KV block a cold "
        "tier stores (disk, remote); the same kind of file as the gate's --encrypt-key-file. A block "
        "no configured key opens is a miss (recomputed), never an error",
    )
    g.add_argument(
        "--kv-encrypt-old-key-file",
        default=None,
        metavar="PATH",
        help="the previous key during a rotation: its blocks are read and resealed with the new key",
    )
    g.add_argument(
        "--kv-disk-ttl-s",
        type=float,
        default=0.0,
        help="delete disk-tier blocks not written or read for this many seconds (a sweeper; default 0: "
        "only the byte budget removes them; see also `tierguard kv purge`)",
    )
    g.add_argument(
        "--kv-naive-sync-disk",
        action="store_true",
        help="BENCHMARK ONLY: spill running sequences' KV to the disk tier and read it back "
        "synchronously inside the step (the failure mode the contract prevents)",
    )


def remote_kwargs(args: argparse.Namespace, host_gib: float) -> dict:
    """`kv_media={"remote": options}` (tierguard/kv/media/remote/tier.py) for --kv-remote-url, else {}.
    The engine looks media up in order: the disk tier first, then this one."""
    url = getattr(args, "kv_remote_url", None)
    if url is None:
        return {}
    check_redis_url(url, "--kv-remote-url")
    if host_gib <= 0:
        raise TierguardError("--kv-remote-url needs --kv-host-gib > 0 (remote blocks move through host RAM)")
    ttl, gib, timeout = args.kv_remote_ttl_s, args.kv_remote_gib, args.kv_remote_timeout_ms
    for flag, value in (
        ("--kv-remote-ttl-s", ttl),
        ("--kv-remote-gib", gib),
        ("--kv-remote-timeout-ms", timeout),
    ):
        if not value > 0:
            raise TierguardError(f"{flag} must be positive, got {value}")
    options = {"url": url, "ttl_s": ttl, "capacity_bytes": int(gib * (1 << 30)), "timeout_ms": timeout}
    return {"kv_media": {"remote": options}}


def check_redis_url(url: str, flag: str) -> None:
    """redis://[[USER]:PASSWORD@]HOST:PORT[/DB][?OPTIONS] (or rediss:// for TLS, unix://PATH,
    redis+cluster://HOST:PORT[,...]); a one-line error that never carries the password."""
    from tierguard.common.redis_client import parse_redis_url

    try:
        target = parse_redis_url(url)
    except ValueError as e:
        raise TierguardError(f"{flag} must be redis://HOST:PORT[/DB] or redis+cluster://HOST:PORT[,...]: {e}") \
            from None
    if not target.cluster and url.startswith("redis") and urlsplit(url).port is None:
        raise TierguardError(f"{flag} {redact_url(url)!r} names no port")


def tier_kwargs(args: argparse.Namespace) -> dict:
    """Engine keyword arguments for the tier flags; raises TierguardError on bad input."""
    from tierguard.kv.contract import parse_ttft_budgets

    for name in ("kv_host_gib", "kv_disk_gib", "kv_disk_ttl_s", "kv_remote_ttl_s", "kv_remote_gib",
                 "kv_remote_timeout_ms"):
        value = getattr(args, name, None)  # argparse's float() takes "nan" and "inf"
        if isinstance(value, float) and not math.isfinite(value):
            raise TierguardError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    host = getattr(args, "kv_host_gib", 0.0) or 0.0
    disk_gib = getattr(args, "kv_disk_gib", 0.0) or 0.0
    disk_dir = getattr(args, "kv_disk_dir", None)
    naive = bool(getattr(args, "kv_naive_sync_disk", False))
    if host < 0:
        raise TierguardError(f"--kv-host-gib must be >= 0, got {host}")
    remote = remote_kwargs(args, host)
    if disk_gib < 0:
        raise TierguardError(f"--kv-disk-gib must be >= 0, got {disk_gib}")
    if disk_dir is not None and disk_gib <= 0:
        raise TierguardError("--kv-disk-dir needs a positive --kv-disk-gib")
    if disk_gib > 0 and disk_dir is None:
        raise TierguardError("--kv-disk-gib needs --kv-disk-dir")
    if disk_dir is not None and Path(disk_dir).exists() and not Path(disk_dir).is_dir():
        raise TierguardError(f"--kv-disk-dir {disk_dir!r} exists and is not a directory")
    if naive and disk_dir is None:
        raise TierguardError("--kv-naive-sync-disk needs a disk tier (--kv-disk-dir and --kv-disk-gib)")
    budgets = getattr(args, "ttft_budget_ms", None)
    at_rest = _at_rest_kwargs(args, disk_dir is not None, naive)
    return {
        **at_rest,
        "kv_host_gib": host,
        "kv_disk_dir": disk_dir,
        "kv_disk_gib": disk_gib,
        "ttft_budget_ms": parse_ttft_budgets(budgets) if budgets else None,
        "naive_sync_disk": naive,
        **remote,
    }


def _at_rest_kwargs(args: argparse.Namespace, has_disk: bool, naive: bool) -> dict:
    """--kv-encrypt-key-file, --kv-encrypt-old-key-file, --kv-disk-ttl-s, checked now (a
    loose, missing or malformed key file is refused before the model loads, as the gate does)."""
    key = getattr(args, "kv_encrypt_key_file", None)
    old = getattr(args, "kv_encrypt_old_key_file", None)
    ttl = getattr(args, "kv_disk_ttl_s", 0.0) or 0.0
    if old is not None and key is None:
        raise TierguardError(
            "--kv-encrypt-old-key-file needs --kv-encrypt-key-file (the key new blocks are sealed with)"
        )
    if key is not None and naive:
        raise TierguardError(
            "--kv-naive-sync-disk (a benchmark mode) spills unencrypted; drop --kv-encrypt-key-file"
        )
    if key is not None:
        from tierguard.common.crypto import Key

        for path in (key, old):
            if path is not None:
                Key.from_file(path)
    if not (0 <= ttl < float("inf")):
        raise TierguardError(f"--kv-disk-ttl-s must be a non-negative number of seconds, got {ttl}")
    if ttl > 0 and not has_disk:
        raise TierguardError("--kv-disk-ttl-s needs a disk tier (--kv-disk-dir and --kv-disk-gib)")
    out: dict = {}
    if key is not None:
        out["kv_encrypt_key_file"] = key
        out["kv_encrypt_old_key_file"] = old
    if ttl > 0:
        out["kv_disk_ttl_s"] = ttl
    return out


def describe_at_rest(args: argparse.Namespace) -> tuple[int, str] | None:
    """(log level, line) saying how KV blocks are kept at rest; None without a disk tier."""
    import logging

    if getattr(args, "kv_disk_dir", None) is None:
        return None
    ttl = getattr(args, "kv_disk_ttl_s", 0.0) or 0.0
    kept = f"deleted after {ttl:g} s untouched" if ttl > 0 else "kept until the byte budget evicts them"
    key = getattr(args, "kv_encrypt_key_file", None)
    if key is None:
        return logging.WARNING, (
            f"KV blocks in {args.kv_disk_dir} are stored unencrypted ({kept}); "
            "pass --kv-encrypt-key-file to encrypt them"
        )
    from tierguard.common.crypto import Key

    key_id = Key.from_file(key).id_hex
    return logging.INFO, f"KV blocks in {args.kv_disk_dir}: AES-256-GCM, key {key_id} ({kept})"
