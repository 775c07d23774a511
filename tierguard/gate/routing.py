"""Which replica a request goes to: routing policies, apart from any HTTP (guidellm style).

A policy only answers "where does this request go" from plain numbers: the replicas
that may take it (healthy, not already tried), the load the gate sees on each, and
the request's prefix keys and session. `upstreams.py` owns the HTTP side (health,
scraping, ejection) and calls `choose`; tests call it with made-up loads.

Load of a replica = requests this gate has in flight there + the queue depth it last
reported on /metrics (vLLM's `vllm:num_requests_waiting`, ours the same name plus
its admission queue). Relative load = load / the largest load among the candidates,
in [0, 1].

`prefix` (SGLang's cache-aware router and the vLLM production-stack router score the
same way): score = matched share of the prompt − β × relative load; the best score
wins. A replica whose load exceeds the least loaded one by more than `imbalance`
requests is overloaded: neither its prefix nor a session sticks to it, so one hot
prefix cannot pile the fleet's work onto one replica. A session (the `user` field or
a header) goes back to the replica that served it last unless that one is overloaded
or gone. Ties go to the less loaded replica, then in turn.

Reasons, counted per upstream on /metrics: prefix_hit (chosen with a matched share
> 0), load (no prefix held anywhere useful: least loaded), sticky (session),
round_robin, failover (a retry after the first choice failed; set by the caller).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tierguard.gate.prefix_index import PrefixIndex

ROUTES = ("prefix", "least-loaded", "round-robin")
REASONS = ("prefix_hit", "load", "sticky", "round_robin", "failover")
MAX_SESSIONS = 100_000  # session -> replica entries kept (LRU)


@dataclass(frozen=True)
class ReplicaLoad:
    """What the gate knows of one candidate replica when it routes."""

    index: int
    in_flight: int = 0  # this gate's requests running there
    queued: int = 0  # the replica's own queue, from its /metrics

    @property
    def load(self) -> int:
        return self.in_flight + self.queued


@dataclass
class RouteRequest:
    keys: list[int] = field(default_factory=list)  # chained prefix hashes (PrefixIndex.keys)
    session: str | None = None


@dataclass(frozen=True)
class RouteDecision:
    replica: int
    reason: str
    share: float = 0.0  # matched share of the prompt on the chosen replica


class Router(Protocol):
    """Invariant: `choose` returns one of `candidates` (which is never empty)."""

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> RouteDecision: ...

    def forget(self, replica: int) -> None:
        """`replica` lost its state (ejected, restarted)."""


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> RouteDecision:
        # The first candidate at or after the cursor, so a replica skipped while unhealthy
        # does not shift everyone else's turn.
        indices = sorted(c.index for c in candidates)
        chosen = next((i for i in indices if i >= self._next), indices[0])
        self._next = chosen + 1
        return RouteDecision(chosen, "round_robin")

    def forget(self, replica: int) -> None:
        pass


class LeastLoaded:
    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> RouteDecision:
        self._turn += 1
        return RouteDecision(_least_loaded(candidates, self._turn).index, "load")

    def forget(self, replica: int) -> None:
        pass


class PrefixAware:
    """Matched prefix share − β × relative load, with sticky sessions; owns the prefix index."""

    name = "prefix"

    def __init__(self, n_replicas: int, beta: float = 0.5, imbalance: int = 8,
                 index: PrefixIndex | None = None, max_sessions: int = MAX_SESSIONS) -> None:
        if beta < 0 or imbalance < 0:
            raise ValueError("beta and imbalance must be >= 0")
        self.beta = beta
        self.imbalance = imbalance
        self.index = index or PrefixIndex(n_replicas)
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> RouteDecision:
        self._turn += 1
        min_load = min(c.load for c in candidates)
        usable = [c for c in candidates if c.load - min_load <= self.imbalance]  # never empty: min is in it
        matched = self.index.matched(request.keys) if request.keys else [0] * self.index.n
        total = len(request.keys)
        decision = None
        if request.session is not None:
            home = self._sessions.get(request.session)
            for c in usable:
                if c.index == home:
                    decision = RouteDecision(home, "sticky", matched[home] / total if total else 0.0)
        if decision is None:
            top = max(c.load for c in usable) or 1

            def score(c: ReplicaLoad) -> float:
                return (matched[c.index] / total if total else 0.0) - self.beta * c.load / top

            best = max(score(c) for c in usable)
            chosen = _least_loaded([c for c in usable if score(c) >= best - 1e-12], self._turn)
            share = matched[chosen.index] / total if total else 0.0
            decision = RouteDecision(chosen.index, "prefix_hit" if share > 0 else "load", share)
        self.index.record(request.keys, decision.replica)
        if request.session is not None:
            self._sessions[request.session] = decision.replica
            self._sessions.move_to_end(request.session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return decision

    def forget(self, replica: int) -> None:
        self.index.forget(replica)
        # sessions keep pointing at it: they move on by themselves while it is not a candidate


def _least_loaded(candidates: Sequence[ReplicaLoad], turn: int) -> ReplicaLoad:
    """The least loaded candidate; among equals, a different one each turn."""
    low = min(c.load for c in candidates)
    equal = [c for c in candidates if c.load == low]
    return equal[turn % len(equal)]


def make_router(route: str, n_replicas: int, beta: float = 0.5, imbalance: int = 8,
                index_entries: int | None = None) -> Router:
    if route == "round-robin":
        return RoundRobin()
    if route == "least-loaded":
        return LeastLoaded()
    if route == "prefix":
        index = PrefixIndex(n_replicas, **({"max_entries": index_entries} if index_entries else {}))
        return PrefixAware(n_replicas, beta=beta, imbalance=imbalance, index=index)
    raise ValueError(f"unknown route {route!r}; use one of {', '.join(ROUTES)}")
