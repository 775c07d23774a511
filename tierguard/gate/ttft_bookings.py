"""Bookings: the places predicted admission keeps for the clients it refused.

A client told "429, Retry-After: N" that comes back as told should find room. So the
refusal keeps its place (an `Entry` without a waiting future, at the back of its class as
it was then) under a key that its retry will have again (`request_key`: its tenant, model,
prompt size and the ends of its prompt, bounded work however long the prompt). The retry,
on time or early, takes that place, and is admitted when its prediction from there is
within its SLO (else it is told again when to come, the place kept). Until it comes back
the booking counts as work ahead of the arrivals it will precede, weighted by
`show_share`, the share of booked clients that did come back (exponentially weighted, 1 at
start), so that clients that never retry soon cost little. One not back within max(2 s, Retry-After / 4) after its time
is dropped. No booking for a wait over `HORIZON_S`, nor beyond `MAX_BOOKINGS`.
"""

from __future__ import annotations

import heapq

import xxhash

from tierguard.gate.ttft_upstream import Entry

HORIZON_S = 60.0  # no booking for a wait longer than this
MAX_BOOKINGS = 1024
SHOW_ALPHA = 0.05  # how fast the share of returning clients follows


def request_key(body: dict, owner: str | None, tokens: int) -> str:
    """Who sent what, cheaply (bounded: the ends of the prompt, not all of it): a retry of
    the same request has the same key."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        content = last.get("content") if isinstance(last, dict) else prompt
        prompt = content if isinstance(content, str) else repr(content)[:4096]
    h = xxhash.xxh64()
    for part in (str(owner), str(body.get("model")), str(tokens), str(len(prompt)), prompt[:512], prompt[-512:]):
        h.update(part.encode("utf-8", "replace"))
        h.update(b"\x00")
    return h.hexdigest()


class Bookings:
    """Key -> (upstream index, entry), with their expiry. One event loop."""

    def __init__(self) -> None:
        self._by_key: dict[str, tuple[int, Entry]] = {}
        self._expiry: list[tuple[float, int, str]] = []
        self.show_share = 1.0
        self.made = self.claimed = self.expired = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def may_book(self, wait_s: float) -> bool:
        return wait_s <= HORIZON_S and len(self._by_key) < MAX_BOOKINGS

    def add(self, key: str, index: int, entry: Entry, retry_s: int, now: float) -> None:
        """Keep `entry` (already in its upstream's queue) for a retry due `retry_s` from now."""
        entry.key, entry.back_at = key, now + retry_s
        entry.expires = entry.back_at + max(2.0, retry_s / 4)
        self._by_key[key] = (index, entry)
        heapq.heappush(self._expiry, (entry.expires, entry.seq, key))
        self.made += 1

    def claim(self, key: str) -> tuple[int, Entry]:
        """The client is back: its booking, no longer one."""
        found = self._by_key.pop(key)
        self.claimed += 1
        self.show_share += SHOW_ALPHA * (1.0 - self.show_share)
        return found

    def expire(self, now: float) -> list[tuple[int, Entry]]:
        """Drop the bookings whose clients did not come back in time; returns them."""
        out = []
        while self._expiry and self._expiry[0][0] <= now:
            _, seq, key = heapq.heappop(self._expiry)
            found = self._by_key.get(key)
            if found is None or found[1].seq != seq:
                continue  # claimed, or booked again since
            del self._by_key[key]
            out.append(found)
            self.expired += 1
            self.show_share += SHOW_ALPHA * (0.0 - self.show_share)
        return out
