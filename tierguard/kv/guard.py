"""The decode guard: the enforcement half of "NVMe is never read inside the decode loop".

The engine enters `decode_guard()` around the decode part of every step. While the
calling thread is inside it, any disk-tier read raises `ColdContractViolation`. The guard
is per thread on purpose: staging reads run on the transfer worker's threads concurrently
with decode (that is the asynchronous path the contract asks for); what is forbidden is
the decode thread itself touching the disk, directly or through a synchronous helper.

The engine enters the guard around scheduling and around the model run of every step
(tierguard/engine/llm_engine.py); `decode_depth()` lets a test assert, from inside a
step, that it runs under the guard. The disk tier counts a refused read
(`reads_in_decode`) before raising. The benchmark-only naive mode
(`--kv-naive-sync-disk`) reads from its own spill tier (tierguard/baselines/naive_kv.py), which
counts such reads instead of refusing them; the production disk tier has no switch.
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


def decode_depth() -> int:
    """How many `decode_guard()` blocks the calling thread is inside (0: none)."""
    return getattr(_state, "depth", 0)


def decode_in_progress() -> bool:
    """True while the calling thread is inside `decode_guard()`."""
    return decode_depth() > 0


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
