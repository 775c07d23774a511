"""The cold contract, in one module: request classes, their budgets, staging deadlines, the
order classes are admitted in, and what to do on a miss.

The connector (connector.py) consults it for deadlines and miss decisions; the engine's
admission policy (tierguard/engine/admission.py) consults it for the class order. Nothing
else knows a class's budget.

Disk staging happens only when a stage of work begins (admission, or the start of a new
turn of a saved session). Its deadline is a share of the request class's TTFT budget,
leaving the rest for the prefill of the uncached tail and the first token:

    arrival ----- staging (staging_share x budget) ----|---- prefill + first token ----| budget

When staging misses its deadline:
- interactive: recompute the prefix now, unless recomputing is itself estimated to blow
  the budget several times over and the request allows it, in which case the request is
  moved to the asynchronous (batch) path;
- batch: keep waiting for the staged blocks; batch tolerates delay and recomputing would
  steal compute from interactive work.
When a staged block fails to arrive (a miss, a bad checksum, the medium down), there is
nothing left to wait for: every class recomputes what was not staged (`decide_on_failure`).
Every decision is counted per class and action and logged with its reason.

Class order at admission (with tiers): an interactive request within LOOKAHEAD of the
head of the queue goes before batch ones; a request that has waited past its own class's
TTFT budget is overtaken by no one (nothing starves), and while it is within budget a
smaller request that fits may pass it. An interactive request that waits for room a
running batch sequence holds makes that sequence yield (it is swapped to host RAM).

The request-class header is `X-Tierguard-Priority` in the gate and in serve; serve's
older `X-Tierguard-Class` request header is still accepted.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from tierguard.common.errors import TierguardError
from tierguard.common.stats import counter

log = logging.getLogger("tierguard.kv.contract")

INTERACTIVE = "interactive"
BATCH = "batch"
REQUEST_CLASSES = (INTERACTIVE, BATCH)
DEFAULT_TTFT_BUDGET_MS = {INTERACTIVE: 1000.0, BATCH: 30000.0}
CLASS_HEADER = "X-Tierguard-Priority"  # the one request-class header (gate and serve)
CLASS_HEADER_ALIAS = "X-Tierguard-Class"  # serve's older name, still accepted
# How far behind the head of the queue admission looks for an interactive request, or for
# a smaller one that fits while the head waits for room.
LOOKAHEAD = 8

# OpenAI's `service_tier` values and common `priority` spellings mapped to our classes.
_ALIASES = {
    "interactive": INTERACTIVE,
    "default": INTERACTIVE,
    "auto": INTERACTIVE,
    "priority": INTERACTIVE,
    "high": INTERACTIVE,
    "realtime": INTERACTIVE,
    "batch": BATCH,
    "flex": BATCH,
    "low": BATCH,
    "background": BATCH,
    "async": BATCH,
}


@dataclass(frozen=True)
class Decision:
    action: str  # "recompute" | "wait" | "async"
    reason: str


@dataclass
class ContractStats:
    decisions: dict[str, int] = counter("Cold-contract decisions by class_action.", "contract_{key}", {})
    deadline_misses: dict[str, int] = counter(
        "Staging deadlines missed per request class.", "staging_deadline_misses_{key}", {}
    )
    stage_failures: dict[str, int] = counter(
        "Loads whose staged blocks did not arrive (miss, bad checksum, medium down) per request class.",
        "staging_failures_{key}",
        {},
    )


def parse_ttft_budgets(text: str) -> dict[str, float]:
    """Parse `--ttft-budget-ms`: "800" (interactive only) or "interactive=800,batch=20000"."""
    budgets = dict(DEFAULT_TTFT_BUDGET_MS)
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        name, sep, value = part.rpartition("=")
        name = name.strip().lower() if sep else INTERACTIVE
        if name not in REQUEST_CLASSES:
            raise TierguardError(
                f"--ttft-budget-ms: unknown request class {name!r}; expected {REQUEST_CLASSES}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise TierguardError(f"--ttft-budget-ms: {value!r} is not a number of milliseconds") from None
        if not 0 < ms < float("inf"):  # nan and inf too: a deadline must be a real time
            raise TierguardError(f"--ttft-budget-ms: budget for {name} must be a positive number, got {value.strip()}")
        budgets[name] = ms
    return budgets


def classify_request(body: Mapping[str, object] | None, headers: Mapping[str, str] | None = None) -> str:
    """Request class from the header, else the body's `priority` or `service_tier` field.

    Unknown or missing values mean interactive: an unlabelled request is treated as if a
    person is waiting for it. Integer priorities follow vLLM: lower is more urgent, so a
    positive priority is batch.
    """
    if headers:
        names = (CLASS_HEADER.lower(), CLASS_HEADER_ALIAS.lower())
        for key, value in headers.items():
            if key.lower() in names and str(value).lower() in _ALIASES:
                return _ALIASES[str(value).lower()]
    body = body or {}
    for field in ("priority", "service_tier"):
        value = body.get(field)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            return BATCH if value > 0 else INTERACTIVE
        if str(value).lower() in _ALIASES:
            return _ALIASES[str(value).lower()]
    return INTERACTIVE


class ColdContract:
    """Deadlines and miss decisions per request class; counts every decision."""

    def __init__(
        self,
        ttft_budget_ms: Mapping[str, float] | None = None,
        staging_share: float = 0.5,
        async_factor: float = 4.0,
    ) -> None:
        if not 0 < staging_share < 1:
            raise TierguardError(f"staging share must be in (0, 1), got {staging_share}")
        self.budgets = dict(DEFAULT_TTFT_BUDGET_MS)
        self.budgets.update(ttft_budget_ms or {})
        self.staging_share = staging_share
        self.async_factor = async_factor
        self._lock = threading.Lock()
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.deadline_misses: Counter[str] = Counter()
        self.stage_failures: Counter[str] = Counter()

    def _budget_ms(self, request_class: str) -> float:
        if request_class not in self.budgets:
            raise ValueError(f"unknown request class {request_class!r}")
        return self.budgets[request_class]

    @staticmethod
    def class_of(label: str) -> str:
        """One of REQUEST_CLASSES for any label a request carries (unknown: interactive)."""
        if label in REQUEST_CLASSES:
            return label
        return classify_request({"service_tier": label})

    def overdue(self, label: str, queued_at: float, now: float) -> bool:
        """Queued longer than its class's TTFT budget: from now on nothing overtakes it."""
        return now - queued_at > self.budgets.get(self.class_of(label), 0.0) / 1000.0

    def goes_first(self, label: str) -> bool:
        """May overtake batch requests within LOOKAHEAD (and make a batch one yield room)."""
        return self.class_of(label) != BATCH

    def yields_room(self, label: str) -> bool:
        """A running request of this class may be swapped out for a waiting one that goes first."""
        return self.class_of(label) == BATCH

    def staging_deadline(self, request_class: str, started_at: float) -> float:
        """Monotonic time by which staged blocks must be on the device."""
        return started_at + self._budget_ms(request_class) * self.staging_share / 1000.0

    def decide_on_miss(
        self,
        request_class: str,
        staged_in_time: bool,
        recompute_ms: float | None = None,
        allow_async: bool = False,
        can_wait: bool = True,
    ) -> Decision:
        """Choose between waiting for staged blocks, recomputing them, or going async.

        `staged_in_time`: the blocks arrived (or will, by the deadline). `recompute_ms`: an
        estimate of the prefill time of the missing prefix, when the caller has one.
        `can_wait=False`: the engine cannot hold the request past this deadline (vLLM's
        connector gives each class one deadline, batch a longer one), so batch recomputes too.
        """
        budget = self._budget_ms(request_class)
        if staged_in_time:
            decision = Decision("wait", "staged within the deadline")
        elif request_class == BATCH and can_wait:
            decision = Decision("wait", "staging missed its deadline; batch tolerates delayed restore")
        elif request_class == BATCH:
            decision = Decision(
                "recompute", "staging missed the batch deadline; the engine holds no request longer"
            )
        elif allow_async and recompute_ms is not None and recompute_ms > self.async_factor * budget:
            decision = Decision(
                "async",
                f"staging missed its deadline and recompute (~{recompute_ms:.0f} ms) exceeds "
                f"{self.async_factor:g}x the {budget:.0f} ms TTFT budget",
            )
        else:
            decision = Decision(
                "recompute", f"staging missed its deadline within a {budget:.0f} ms TTFT budget"
            )
        with self._lock:
            self.decisions[(request_class, decision.action)] += 1
            if not staged_in_time:
                self.deadline_misses[request_class] += 1
        log.info(
            "cold contract: class=%s action=%s reason=%s", request_class, decision.action, decision.reason
        )
        return decision

    def decide_on_failure(self, request_class: str, reason: str) -> Decision:
        """Staged blocks failed to arrive (a miss, a bad checksum, the medium down). Nothing
        is left to wait for, so every class recomputes what was not staged; counted as a
        decision like a missed deadline."""
        decision = Decision("recompute", f"staging failed: {reason}")
        with self._lock:
            self.decisions[(request_class, decision.action)] += 1
            self.stage_failures[request_class] += 1
        log.info("cold contract: class=%s action=recompute reason=%s", request_class, decision.reason)
        return decision

    def stats(self) -> ContractStats:
        with self._lock:
            return ContractStats(
                {f"{cls}_{action}": n for (cls, action), n in self.decisions.items()},
                dict(self.deadline_misses),
                dict(self.stage_failures),
            )
