"""How many prefill tokens a step that carries decodes may take (`--target-itl-ms`).

Why: a step's duration is the inter-token gap of every stream decoding in it. With a
fixed token budget, one 256-token prefill landing beside the decodes made that gap 10x
a decode step (SmolLM2 on 2 cores: ~870 ms), and `tierguard sweep` put the boundary at
one stream. Decodes go first and are never cut; prefill chunks are sized from what the
steps themselves took:

    step time  = max(target, (1 + prefill_share) x decode step time at this batch)
    prefill tokens = (step time - decode step time - fixed) / prefill time per token

all learned from the engine's own steps: decode-only steps give the decode step time
by batch size (moving averages); every step with prefill beside decodes gives a point
(its tokens, its time over its decodes' estimate) to a straight-line fit, whose intercept
is the fixed cost of a step that carries prefill (one more pass over the weights, the
per-op path's overheads) and whose slope is the time per prefill token (PrefillCost).
Steps of prefill alone only seed the estimate until a mixed step is seen: they run
another path (long chunks, a GEMM on whole weight tiles) at about half the per-token
cost of a small chunk in a fused step with decodes, and one line through both regimes
(SmolLM2 int8: 240 tokens alone in 676 ms, 14 beside a decode in 69 ms) had a 31 ms
intercept that no mixed step has; admission read it as no room and ran the server one
sequence at a time (32 tok/s at C=32, p99 gap 49 ms for a 90 ms SLO). A ratio alone
(time over tokens) charged a 16-token chunk the fixed cost that a 256-token one spreads:
chunks sized by it overshot the SLO (SmolLM2 int8, C=32: 142 ms steps for a 100 ms SLO).
A step without decodes is not limited (no stream waits on it). When the decodes alone take
about the target or more (a large batch, a slow CPU), a fixed target would starve the
prefills: at 8 streams of SmolLM2 on 2 cores the decodes took ~150 ms, prefills got the
16-token minimum, and output fell to 18 tok/s (29 with no budget at all). So prefills
always get `prefill_share` of the decode time: the gap grows by at most that factor
over a decode-only step, and new requests keep flowing in.

That is a throughput-first target. `--itl-slo-ms` is the latency-first one: a step that
carries decodes is kept under it (prefills get what the decodes and the fixed cost
leave, at least `SLO_MIN_TOKENS` so the queue moves), and a new sequence starts only
while a step with one more decode would still leave room for that smallest chunk
(before any prefill was measured: while the decodes alone take at most
`SLO_DECODE_SHARE` of it; after `SLO_REPROBE_STEPS` steps without a mixed step, the fit's
slope alone, so a stale intercept cannot close admission for good). The fit is noisy where chunks hardly vary (a slope from
points of 10-24 tokens let a 65-token chunk through: a 247 ms step under a 90 ms SLO),
so under an SLO the chunk also has a cap that backs off and probes (AIMD): a step over
the SLO sets it to `SLO_BACKOFF` x that step's chunk, and each step that used the whole
cap and stayed under raises it by `SLO_PROBE_TOKENS`. Whoever does not fit waits in
the queue (TTFT grows) instead of slowing every running stream: on 2 CPU cores a
32-sequence decode step alone is several times a 1-sequence one, so without a cap the
inter-token gap at high concurrency is set by the batch, not by the target. The decode
time of a batch size not yet seen is scaled linearly from the nearest smaller one (an
upper bound: one row's cost more), so admission never plans a step over the SLO.
Policy only: the scheduler asks, the engine reports each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Before any prefill was measured (a decode is running but nothing was prefilled alone
# yet, e.g. after a restart of the estimates), chunks are capped here.
UNMEASURED_CHUNK = 64
# With an ITL SLO and no prefill measured yet, the share of it the decodes alone may take.
SLO_DECODE_SHARE = 0.6
# With an ITL SLO, the smallest chunk a step with decodes still takes when the SLO leaves
# less room: the queue keeps moving (a few ms over the SLO) instead of starving.
SLO_MIN_TOKENS = 4
# The SLO chunk cap (AIMD): its cut after a step over the SLO, and its rise after a full one under.
SLO_BACKOFF = 0.75
SLO_PROBE_TOKENS = 2
# With an ITL SLO, a wave (sequences that start decoding together: scheduler.py) grows while
# a decode step at its size is estimated within this share of the SLO (the rest: noise).
SLO_WAVE_SHARE = 0.75
# With an ITL SLO, after this many steps without a step of prefill beside decodes, one new
# sequence may start on the fit's slope alone (its intercept is set aside): see `admits`.
SLO_REPROBE_STEPS = 96


@dataclass
class PrefillCost:
    """time ~ fixed + per_token x tokens, least squares over exponentially decayed sums
    (the newest step weighs 1, one `k` steps older (1 - alpha)^k).

    Invariant: `solve()` never returns a negative slope or intercept; points whose token
    counts hardly vary (no spread to tell the two apart) give a ratio through the origin.
    """

    alpha: float = 0.1
    s0: float = 0.0  # sum of weights
    s1: float = 0.0  # sum of w x tokens
    s2: float = 0.0  # sum of w x tokens^2
    t0: float = 0.0  # sum of w x ms
    t1: float = 0.0  # sum of w x tokens x ms

    def add(self, tokens: int, ms: float) -> None:
        k = 1.0 - self.alpha
        n = float(tokens)
        self.s0, self.s1, self.s2 = k * self.s0 + 1.0, k * self.s1 + n, k * self.s2 + n * n
        self.t0, self.t1 = k * self.t0 + ms, k * self.t1 + n * ms

    def solve(self) -> tuple[float, float] | None:
        """(fixed ms, ms per token > 0), or None before any point that took time."""
        if self.s1 <= 0:
            return None
        det = self.s0 * self.s2 - self.s1 * self.s1
        if det > 0.01 * self.s0 * self.s2:  # the token counts vary: two unknowns
            per = (self.s0 * self.t1 - self.s1 * self.t0) / det
            fixed = (self.t0 - per * self.s1) / self.s0
            if per > 0 and fixed >= 0:
                return fixed, per
        if self.t0 <= 0:  # every step took no longer than its decodes: no slope to divide by
            return None
        return 0.0, self.t0 / self.s1


@dataclass
class StepBudget:
    target_ms: float = 0.0  # 0: no limit
    min_tokens: int = 16
    prefill_share: float = 1.0  # prefill time allowed per step, as a fraction of the decode time
    alpha: float = 0.25  # weight of the newest step in the decode-time averages
    ms_per_prefill_token: float | None = None  # the fit's slope (PrefillCost)
    prefill_fixed_ms: float = 0.0  # the fit's intercept
    decode_ms: dict[int, float] = field(default_factory=dict)  # decode-only step time by batch size
    slo_ms: float = 0.0  # --itl-slo-ms: 0 off
    prefill_cost: PrefillCost = field(default_factory=PrefillCost)  # steps with decodes
    alone_cost: PrefillCost = field(default_factory=PrefillCost)  # prefill-only steps: the seed
    slo_cap: float = float("inf")  # SLO chunk cap (AIMD); unset until a step overshoots
    steps_since_mixed: int = 0  # steps observed since the last one with prefill beside decodes

    def __post_init__(self) -> None:
        if self.slo_ms > 0:  # the SLO is also the step target
            self.target_ms = self.slo_ms

    @property
    def enabled(self) -> bool:
        return self.target_ms > 0

    def admits(self, num_running: int) -> bool:
        """Whether a new sequence may start beside `num_running` ones (always without an
        SLO, and always into an empty batch): a step with one more decode must still
        leave room for the smallest chunk (`SLO_MIN_TOKENS`) within the SLO."""
        if self.slo_ms <= 0 or num_running == 0:
            return True
        want = num_running + 1
        known = [b for b in self.decode_ms if b <= want]
        if not known:
            return True
        smaller = [b for b in known if b < want]
        if smaller:
            # One more row adds at most its share: a batch's estimate is kept within the
            # linear scaling of a smaller one's. Without it one slow 2-decode step (32
            # requests arriving at once, 100 ms) refused every second sequence, and as
            # nothing then ran at 2 the estimate never healed: 18 s of one-at-a-time.
            # A size not measured yet gets that scaling itself: the smaller one's time
            # (the old guess) left no room for the new row's cost, and the chunk beside it
            # ran over the SLO for its whole prompt (SmolLM2 int8, 15 ms SLO: 16-17 ms
            # steps at 4 tokens, 2.2 ms a row).
            b = max(smaller)
            decode = min(self.decode_ms.get(want, math.inf), self.decode_ms[b] * want / b)
        else:
            decode = self.decode_ms[want]
        if self.ms_per_prefill_token is None:
            return decode <= SLO_DECODE_SHARE * self.slo_ms
        chunk = SLO_MIN_TOKENS * self.ms_per_prefill_token
        if decode + self.prefill_fixed_ms + chunk <= self.slo_ms:
            return True
        # Only steps with prefill beside decodes update the fit, and a refusal here stops
        # them: one noisy intercept (the least certain part of a fit over 4-8 token chunks)
        # ran the server one sequence at a time until restart, 61 instead of 73-80 tok/s
        # at C=32 in the same bench. So after SLO_REPROBE_STEPS steps without one, a
        # sequence may start on the slope alone, and its chunks measure the line again.
        if self.steps_since_mixed >= SLO_REPROBE_STEPS and decode + chunk <= self.slo_ms:
            self.steps_since_mixed = 0  # one probe per window
            return True
        return False

    def wave_admits(self, num_members: int) -> bool:
        """Whether a wave of `num_members` (none decoding yet) may take one more: its decode
        step at the new size must stay within `SLO_WAVE_SHARE` of the SLO. A size not
        measured yet is estimated by linear scaling from the nearest one measured (an upper
        bound: a decode step grows less than linearly), so waves grow as their steps are
        measured; before any decode step was measured a wave is one sequence."""
        if self.slo_ms <= 0 or not self.decode_ms:
            return False
        return self.decode_step_ms(num_members + 1) <= SLO_WAVE_SHARE * self.slo_ms

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
        if self.slo_ms > 0:
            room, floor = self.target_ms - decode, SLO_MIN_TOKENS
        else:
            room, floor = max(self.target_ms, (1.0 + self.prefill_share) * decode) - decode, self.min_tokens
        fit = int((room - self.prefill_fixed_ms) / self.ms_per_prefill_token + 1e-9)
        if self.slo_ms > 0 and self.slo_cap < fit:
            fit = int(self.slo_cap)
        return min(limit, max(floor, fit))

    def observe(self, num_decodes: int, prefill_tokens: int, seconds: float) -> None:
        """One finished step: how many decodes and prefill tokens it carried, how long it took."""
        ms = seconds * 1000.0
        self.steps_since_mixed = 0 if (num_decodes and prefill_tokens) else self.steps_since_mixed + 1
        if prefill_tokens == 0:
            if num_decodes:
                old = self.decode_ms.get(num_decodes)
                self.decode_ms[num_decodes] = ms if old is None else old + self.alpha * (ms - old)
            return
        if num_decodes:
            self.prefill_cost.add(prefill_tokens, max(ms - self.decode_step_ms(num_decodes), 0.0))
            if self.slo_ms > 0:
                if ms > self.slo_ms:
                    self.slo_cap = max(float(SLO_MIN_TOKENS), SLO_BACKOFF * prefill_tokens)
                elif math.isfinite(self.slo_cap) and prefill_tokens >= int(self.slo_cap):
                    self.slo_cap += SLO_PROBE_TOKENS
        else:
            self.alone_cost.add(prefill_tokens, ms)
        fit = self.prefill_cost.solve() or self.alone_cost.solve()
        if fit is not None:
            self.prefill_fixed_ms, self.ms_per_prefill_token = fit
