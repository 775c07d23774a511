"""What happened to one request, and the timing quantities derived from it.

All times are seconds on CLOCK_MONOTONIC relative to the run's start `t0`, shared by
every worker process (Linux's monotonic clock is system-wide).

Timing definitions (the ones tierguard reports):

    scheduled ── queue wait ──> slot ── send ──> first token ─ gap ─> chunk ... ─> end
    |<───────────────── TTFT ──────────────────>|
    |<────────────────────────────── E2EL ───────────────────────────────────────>|

* TTFT and E2EL are measured from the SCHEDULED send time, so a client that sends late
  or queues requests for a concurrency slot cannot hide that wait. The slot wait itself
  is `queue_wait`; in closed-loop mode (rate inf with a limit) a request is due when
  its slot opens, so it is zero there.
* A chunk is one SSE event that carried k >= 1 new tokens. An inter-chunk gap is the
  time between two such events. Per-token ITL: a chunk with k tokens arriving a gap g
  after the previous one contributes k samples of g/k — the tokens came out of the
  server evenly over g as far as the client can know. Tokens that share the FIRST chunk
  contribute no ITL sample (their wait is inside TTFT); hence the per-token ITL samples
  of a request sum exactly to E2EL − TTFT and number output_tokens − k_first.
* TPOT = (E2EL − TTFT) / (output_tokens − 1), as vLLM defines it.
* The stall of a request = its longest inter-chunk gap minus its median inter-chunk
  gap: the freeze beyond the stream's own cadence (≈0 for a smooth stream, ≈500 ms for a
  500 ms pause whatever the chunk size). The raw longest gap is kept as `max_gap_ms`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

OK, FAILED, TIMEOUT, REJECTED, CANCELLED = "ok", "failed", "timeout", "rejected", "cancelled"


@dataclass
class RequestRecord:
    index: int
    worker: int = 0
    input_len: int = 0
    output_len_requested: int = 0
    group: str = ""
    phase: str = "measure"  # "warmup" | "measure" | "cooldown"
    scheduled_s: float = 0.0
    dispatched_s: float | None = None  # when the dispatcher got to it (timer lateness)
    slot_s: float | None = None  # when it held a concurrency slot
    sent_s: float | None = None  # just before the HTTP request was issued
    connect_ms: float | None = None  # TCP/TLS set-up, None when a pooled connection was reused
    headers_s: float | None = None  # response headers received
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # token-carrying chunks only
    chunk_tokens: list[int] = field(default_factory=list)
    token_count_source: str = ""  # usage_delta | tokenizer | usage_total | chunk_count
    prompt_tokens: int | None = None  # as reported by the server
    output_tokens: int = 0
    status: str = CANCELLED
    http_status: int | None = None
    error: str | None = None
    retried_without: list[str] = field(default_factory=list)
    response_id: str | None = None

    # ---- derived quantities (milliseconds) ----
    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else (self.first_token_s - self.scheduled_s) * 1000.0

    @property
    def e2el_ms(self) -> float | None:
        return None if self.end_s is None or not self.ok else (self.end_s - self.scheduled_s) * 1000.0

    @property
    def queue_wait_ms(self) -> float | None:
        return None if self.slot_s is None or self.dispatched_s is None else (self.slot_s - self.dispatched_s) * 1000.0

    @property
    def send_lateness_ms(self) -> float | None:
        """Client-caused delay: scheduled → actually sent, minus the concurrency wait."""
        if self.sent_s is None:
            return None
        return (self.sent_s - self.scheduled_s) * 1000.0 - (self.queue_wait_ms or 0.0)

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or not self.chunk_times_s:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) * 1000.0 / (self.output_tokens - 1)

    def chunk_gaps_ms(self) -> np.ndarray:
        return np.diff(np.asarray(self.chunk_times_s)) * 1000.0

    def itl_samples_ms(self) -> np.ndarray:
        """Per-token ITL: each later chunk's gap divided evenly over its k tokens."""
        gaps = self.chunk_gaps_ms()
        if gaps.size == 0:
            return gaps
        k = np.asarray(self.chunk_tokens[1:], dtype=float)
        keep = k > 0
        return np.repeat(gaps[keep] / k[keep], k[keep].astype(int))

    @property
    def max_gap_ms(self) -> float | None:
        gaps = self.chunk_gaps_ms()
        return float(gaps.max()) if gaps.size else None

    @property
    def stall_ms(self) -> float | None:
        gaps = self.chunk_gaps_ms()
        return float(gaps.max() - np.median(gaps)) if gaps.size else None

    def to_json(self) -> dict:
        d = asdict(self)
        d["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        for k in ("ttft_ms", "e2el_ms", "tpot_ms", "queue_wait_ms", "send_lateness_ms", "max_gap_ms", "stall_ms"):
            v = getattr(self, k)
            d[k] = None if v is None else round(v, 3)
        return d

    @classmethod
    def from_json(cls, d: dict) -> RequestRecord:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})
