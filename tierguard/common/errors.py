"""User-facing errors.

A `TierguardError` is bad input or an environment problem the user can fix. The CLI
prints its message on one line and exits with code 2; it never shows a traceback.
"""

from __future__ import annotations


class TierguardError(Exception):
    """A problem the user can fix; the message names it."""

    exit_code = 2
