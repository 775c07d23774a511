"""`tierguard kv`: operator commands on the KV tiers' files (today: purge).

    tierguard kv purge DIR [--older-than 7d] [--fingerprint FP] [--dry-run]

DIR is a server's `--kv-disk-dir`. One line per fingerprint directory says what was
removed; bad input is one line on stderr and exit 2. The rules (what it touches, and
what "older" means) are in tierguard/kv/media/disk/purge.py and docs/cold-contract.md.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "kv", help="operator commands on the KV tiers' files (purge)", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="kv_command", metavar="KV_COMMAND", parser_class=type(p))
    purge = sub.add_parser(
        "purge",
        help="delete disk-tier block files (all, or those not used for a while)",
        description="Delete disk-tier block files under DIR (a server's --kv-disk-dir). Only files the "
        "tier wrote are touched: intact block files and dead writers' temporary files.",
    )
    purge.add_argument("dir", metavar="DIR", help="the disk tier directory (--kv-disk-dir)")
    purge.add_argument(
        "--older-than",
        metavar="DURATION",
        default=None,
        help="only blocks not written or read for this long, e.g. 90s, 15m, 2h, 7d (default: all)",
    )
    purge.add_argument(
        "--fingerprint", metavar="FP", default=None, help="only this model fingerprint's directory"
    )
    purge.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    return p


def run(args: argparse.Namespace) -> int:
    from tierguard.common.errors import TierguardError

    if args.kv_command != "purge":
        raise TierguardError("tierguard kv needs a command: purge (see 'tierguard kv --help')")
    from tierguard.common.units import parse_duration
    from tierguard.kv.media.disk.purge import purge_dir, tier_dirs

    older = parse_duration(args.older_than, "--older-than") if args.older_than is not None else None
    dirs = tier_dirs(args.dir, args.fingerprint)
    if not dirs:
        print(f"nothing to purge: {args.dir} holds no KV tier directories")
        return 0
    for fp in dirs:
        report = purge_dir(args.dir, fp, older, args.dry_run)
        print(report.line(args.dry_run, args.older_than))
    return 0
