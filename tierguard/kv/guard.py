"""The decode guard: the enforcement half of "NVMe is never read inside the decode loop".

The engine enters `decode_guard()` around the decode part of every step. While the
calling thread is inside it, any disk-tier read raises `ColdContractViolation`. The guard
is per thread on purpose: staging reads run on the transfer worker's threads concurrently
with decode (that is the asynchronous path the contract asks for); what is forbidden is
the decode thread itself touching the disk, directly or through a synchronous helper.

The benchmark-only naive mode (`--kv-naive-sync-disk`) constructs its disk tier with
`allow_reads_in_decode=True`; such reads are counted, never silent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ColdContractViolation(RuntimeError):
    """A programming error: code on the decode path tried to read the disk tier.

    Not a user error and never caught by the tiers; a test that sees it has found a path
    from the decode loop to the disk.
    """


_state = threading.local()


def decode_in_progress() -> bool:
    """True while the calling thread is inside `decode_guard()`."""
    return getattr(_state, "depth", 0) > 0


@contextmanager
def decode_guard() -> Iterator[None]:
    """Mark the calling thread as running a decode step (re-entrant)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def check_disk_read_allowed(what: str) -> None:
    """Raise `ColdContractViolation` if called from inside a decode step."""
    if decode_in_progress():
        raise ColdContractViolation(f"disk tier read ({what}) attempted inside a decode step")
