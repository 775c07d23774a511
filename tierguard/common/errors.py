"""User-facing errors.

A `TierguardError` is bad input or an environment problem the user can fix. The CLI
prints its message on one line and exits with code 2; it never shows a traceback.
"""

from __future__ import annotations

import os
from pathlib import Path


class TierguardError(Exception):
    """A problem the user can fix; the message names it."""

    exit_code = 2


def read_text(path: str | os.PathLike, what: str) -> str:
    """A user's UTF-8 text file (a matrix, a config, a trace), or one TierguardError naming
    `what`, the path and the problem: missing, unreadable, or not UTF-8 (with the offset
    of the first bad byte)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise TierguardError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TierguardError(f"{what} {str(path)!r} is not UTF-8 text (byte {raw[exc.start]:#04x} "
                             f"at offset {exc.start})") from None
