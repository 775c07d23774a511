"""The `tierguard` console script: one entry point, one module per subcommand.

Each subcommand lives in `tierguard/cli/<name>.py` and exposes
`add_parser(subparsers) -> argparse.ArgumentParser` and `run(args) -> int`.
Modules must not import torch at import time (keeps `tierguard plan` instant).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tierguard import __version__
from tierguard.common.errors import TierguardError

# Order is the order shown in --help.
COMMANDS = ["plan", "model", "serve", "bench", "kvcheck", "topo", "gate", "sweep", "predict", "report", "demo", "kv"]


class _Parser(argparse.ArgumentParser):
    """argparse exits with 2 on bad flags already; keep its message on one line (no usage
    block: the full usage of a subcommand runs to 20 lines and buries the problem)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"tierguard: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tierguard",
        description="LLM inference that borrows host RAM and NVMe without letting p99 latency collapse, "
        "and proves it by measurement.",
    )
    parser.add_argument("--version", action="version", version=f"tierguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"tierguard.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"tierguard.cli.{name}":
                continue  # command not built yet
            raise
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except TierguardError as exc:
        print(f"tierguard: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a path the user named cannot be read or written: their problem, one line
        where = f": {exc.filename}" if exc.filename else ""
        print(f"tierguard: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tierguard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
