"""Whether a run that claims unique prompts had them: the server's own prefix-cache counters.

A benchmark that replays its prompts measures the prefix cache, not prefill: a level that
reuses an earlier level's prompts skips most of their prefill on any engine with prefix
caching. So a run that claims unique prompts reads the server's counters before and after
and compares the hits with what the prompts legitimately share, the chat template's
tokens in front of every message.

Counters read: `vllm:prefix_cache_hits_total` and `vllm:prefix_cache_queries_total`
(prompt tokens found in, and looked up in, the prefix cache), which vLLM and
`tierguard serve` both export. A server without them (llama.cpp, transformers) gives
None: nothing to check, and the report says so rather than claiming a pass.

Contract:
  - `read_counters(url)` never raises: None when /metrics is missing, unreadable or lacks
    the counters;
  - `shared_prefix_tokens(prompts)` is the length of the token prefix common to every
    prompt (0 for fewer than two);
  - `UniqueBodies.take()` hands out each body once, in order, then None: a run that
    draws every level from one of them never sends a prompt twice;
  - `judge(before, after, requests, shared)` allows `requests x shared` hit tokens (an
    engine caches whole blocks, so it never finds more of a shared prefix than its
    length) and names the excess otherwise.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from tierguard.bench.scrape import parse_metrics

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


class UniqueBodies:
    """Request bodies drawn without replacement across a whole run, levels included."""

    def __init__(self, bodies: Sequence[Any]) -> None:
        if not bodies:
            raise ValueError("UniqueBodies needs at least one body")
        self._bodies = list(bodies)
        self.used = 0

    @property
    def first(self) -> Any:
        return self._bodies[0]

    def take(self) -> Any | None:
        """The next body never handed out, or None when all were."""
        if self.used >= len(self._bodies):
            return None
        self.used += 1
        return self._bodies[self.used - 1]


def read_counters(base_url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """{"hits": tokens, "queries": tokens} summed over label sets, or None."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            text = r.read(8 << 20).decode("utf-8", "replace")
        samples = parse_metrics(text)
    except (urllib.error.URLError, OSError, ValueError):
        return None
    out = {"hits": 0.0, "queries": 0.0}
    seen = False
    for key, value in samples.items():
        name = key.split("{", 1)[0]
        if name in (HITS, QUERIES):
            out["hits" if name == HITS else "queries"] += value
            seen = True
    return out if seen else None


def shared_prefix_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens at the front of every prompt (e.g. the chat template's), 0 for fewer than two."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts)
    first = prompts[0]
    for i in range(n):
        if any(p[i] != first[i] for p in prompts[1:]):
            return i
    return n


def judge(before: dict[str, float] | None, after: dict[str, float] | None, requests: int, shared: int) -> dict:
    """The counts for the run's JSON and, where the hits exceed what the shared prefix
    explains, the reason the run is invalid (`reason`, else None)."""
    if before is None or after is None:
        return {"prefix_cache_hit_tokens": None, "allowed_hit_tokens": None, "reason": None,
                "note": "the server exports no prefix-cache counters: reuse not checked"}
    hits = after["hits"] - before["hits"]
    allowed = requests * shared
    out = {"prefix_cache_hit_tokens": int(hits), "prefix_cache_query_tokens": int(after["queries"] - before["queries"]),
           "allowed_hit_tokens": allowed, "reason": None}
    if hits > allowed:
        out["reason"] = (f"the server found {int(hits):,} prompt tokens in its prefix cache, more than the "
                         f"{allowed:,} the {shared} shared template tokens of {requests} requests explain: prompts were reused")
    return out
