"""How many prefill tokens a step that carries decodes may take (`--target-itl-ms`).

Why: a step's duration is the inter-token gap of every stream decoding in it. With a
fixed token budget, one 256-token prefill landing beside the decodes made that gap 10x
a decode step (SmolLM2 on 2 cores: ~870 ms), and `tierguard sweep` put the boundary at
one stream. Decodes go first and are never cut; prefill chunks are sized from what the
steps themselves took:

    step time  = max(target, (1 + prefill_share) x decode step time at this batch)
    prefill tokens = (step time - decode step time) / prefill time per token

both learned as moving averages of the engine's own steps (decode-only steps give the
first, steps with prefill the second, after their decode part is taken off). A step
without decodes is not limited (no stream waits on it). When the decodes alone take
about the target or more (a large batch, a slow CPU), a fixed target would starve the
prefills: at 8 streams of SmolLM2 on 2 cores the decodes took ~150 ms, prefills got the
16-token minimum, and output fell to 18 tok/s (29 with no budget at all). So prefills
always get `prefill_share` of the decode time: the gap grows by at most that factor
over a decode-only step, and new requests keep flowing in.

That is a throughput-first target. `--itl-slo-ms` is the latency-first one: a step that
carries decodes is kept under it (prefills get what the decodes leave, at least
`min_tokens`), and a new sequence starts only while the decode step at the larger batch
is expected to take at most `SLO_DECODE_SHARE` of it. Whoever does not fit waits in
the queue (TTFT grows) instead of slowing every running stream: on 2 CPU cores a
32-sequence decode step alone is several times a 1-sequence one, so without a cap the
inter-token gap at high concurrency is set by the batch, not by the target. The decode
time of a batch size not yet seen is taken from the nearest smaller one (optimistic:
one more sequence is tried, its steps are measured, and the cap settles).
Policy only: the scheduler asks, the engine reports each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Before any prefill was measured (a decode is running but nothing was prefilled alone
# yet, e.g. after a restart of the estimates), chunks are capped here.
UNMEASURED_CHUNK = 64
# With an ITL SLO, the share of it the decodes alone may take (the rest is prefill room).
SLO_DECODE_SHARE = 0.6


@dataclass
class StepBudget:
    target_ms: float = 0.0  # 0: no limit
    min_tokens: int = 16
    prefill_share: float = 1.0  # prefill time allowed per step, as a fraction of the decode time
    alpha: float = 0.25  # weight of the newest step in the moving averages
    ms_per_prefill_token: float | None = None
    decode_ms: dict[int, float] = field(default_factory=dict)  # decode-only step time by batch size
    slo_ms: float = 0.0  # --itl-slo-ms: 0 off

    def __post_init__(self) -> None:
        if self.slo_ms > 0:  # the SLO is also the step target
            self.target_ms = self.slo_ms

    @property
    def enabled(self) -> bool:
        return self.target_ms > 0

    def admits(self, num_running: int) -> bool:
        """Whether a new sequence may start beside `num_running` ones (always without an
        SLO, and always into an empty batch)."""
        if self.slo_ms <= 0 or num_running == 0:
            return True
        want = num_running + 1
        known = [b for b in self.decode_ms if b <= want]
        if not known:
            return True
        return self.decode_ms[max(known)] <= SLO_DECODE_SHARE * self.slo_ms

    def decode_step_ms(self, num_decodes: int) -> float:
        """Estimated time of a decode-only step: the measured batch size, else the nearest
        measured one scaled linearly (a decode step grows with its batch)."""
        if num_decodes in self.decode_ms:
            return self.decode_ms[num_decodes]
        if not self.decode_ms:
            return 0.0
        near = min(self.decode_ms, key=lambda b: abs(b - num_decodes))
        return self.decode_ms[near] * max(1.0, num_decodes / near)

    def prefill_tokens(self, num_decodes: int, limit: int) -> int:
        """Prefill tokens allowed in a step that has `num_decodes` decodes (<= limit)."""
        if not self.enabled or num_decodes == 0:
            return limit
        if self.ms_per_prefill_token is None:
            return min(limit, UNMEASURED_CHUNK)
        decode = self.decode_step_ms(num_decodes)
        share = 0.0 if self.slo_ms > 0 else self.prefill_share
        room = max(self.target_ms, (1.0 + share) * decode) - decode
        return min(limit, max(self.min_tokens, int(room / self.ms_per_prefill_token)))

    def observe(self, num_decodes: int, prefill_tokens: int, seconds: float) -> None:
        """One finished step: how many decodes and prefill tokens it carried, how long it took."""
        ms = seconds * 1000.0
        if prefill_tokens == 0:
            if num_decodes:
                old = self.decode_ms.get(num_decodes)
                self.decode_ms[num_decodes] = ms if old is None else old + self.alpha * (ms - old)
            return
        per = max(ms - (self.decode_step_ms(num_decodes) if num_decodes else 0.0), 0.0) / prefill_tokens
        old = self.ms_per_prefill_token
        self.ms_per_prefill_token = per if old is None else old + self.alpha * (per - old)
