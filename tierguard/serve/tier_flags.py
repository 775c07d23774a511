"""`tierguard serve` flags of the tiered KV store and the cold contract.

Kept out of cli/serve.py so that file stays small; imports nothing heavy (no torch), as
the CLI requires. Validation happens here, before the model loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from urllib.parse import urlsplit

from tierguard.common.errors import TierguardError


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
        help="shared remote KV tier on Redis, redis://HOST:PORT[/DB]: full prefix blocks are written "
        "behind the answer and read by every replica naming the same Redis (needs --kv-host-gib)",
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
        "--kv-naive-sync-disk",
        action="store_true",
        help="BENCHMARK ONLY: spill running sequences' KV to the disk tier and read it back "
        "synchronously inside the step (the failure mode the contract prevents)",
    )


def remote_kwargs(args: argparse.Namespace, host_gib: float) -> dict:
    """`kv_media={"remote": options}` (tierguard/kv/remote_tier.py) for --kv-remote-url, else {}.
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
    """redis://HOST:PORT[/DB] (or rediss://, unix://PATH); a one-line error otherwise."""
    try:
        parts = urlsplit(url)
        port, db = parts.port, parts.path.strip("/")
    except ValueError as e:
        raise TierguardError(f"{flag} {url!r}: {e}") from None
    if parts.scheme == "unix" and parts.path:
        return
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise TierguardError(f"{flag} must be redis://HOST:PORT[/DB], got {url!r}")
    if port is None:
        raise TierguardError(f"{flag} {url!r} names no port")
    if db and not db.isdigit():
        raise TierguardError(f"{flag} {url!r}: the database must be a number, got {db!r}")


def tier_kwargs(args: argparse.Namespace) -> dict:
    """Engine keyword arguments for the tier flags; raises TierguardError on bad input."""
    from tierguard.kv.contract import parse_ttft_budgets

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
    return {
        "kv_host_gib": host,
        "kv_disk_dir": disk_dir,
        "kv_disk_gib": disk_gib,
        "ttft_budget_ms": parse_ttft_budgets(budgets) if budgets else None,
        "naive_sync_disk": naive,
        **remote,
    }
