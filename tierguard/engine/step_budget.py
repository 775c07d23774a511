"""How many prefill tokens a step that carries decodes may take, and whether the batch may grow.

A step's duration is the inter-token gap of every stream decoding in it, so one long
prefill beside the decodes stretches every stream's gap by its whole length. Decodes go
first and are never cut; prefill chunks are sized from what the engine's own steps took:

    step time      = max(target, (1 + prefill_share) x decode step time at this batch)
    prefill tokens = (step time - decode step time - fixed) / prefill time per token

Decode-only steps give the decode step time by batch size (moving averages). Every step
with prefill beside decodes gives a point (its tokens, its time over its decodes'
estimate) to a straight-line fit (`PrefillCost`): the intercept is the fixed cost of a
step that carries prefill (one more pass over the weights, the per-op path's overheads),
the slope the time per prefill token. A ratio alone (time over tokens) would charge a
small chunk the fixed cost a long one spreads, and overshoot. Steps of prefill alone only
seed the estimate until a mixed step is seen: they run another path at a lower cost per
token, and one line through both regimes has an intercept no mixed step has, which
reads as no room. A step without decodes is not limited (no stream waits on it).

`--target-itl-ms` is throughput-first: where the decodes alone take about the target or
more (a large batch, a slow CPU), a fixed target would starve the prefills, so prefills
always get `prefill_share` of the decode time: the gap grows by at most that factor
over a decode-only step, and new requests keep flowing in.

`--itl-slo-ms` is latency-first: a step that carries decodes is kept under it (prefills
get what the decodes and the fixed cost leave, at least `SLO_MIN_TOKENS` so the queue
moves), and a new sequence starts only while a step with one more decode would still
leave room for that smallest chunk. The fit is noisy where chunks hardly vary, so under
an SLO the chunk also has a cap that backs off and probes (AIMD): a step over the SLO
sets it to `SLO_BACKOFF` x that step's chunk, and each step that used the whole cap and
stayed under raises it by `SLO_PROBE_TOKENS`. Whoever does not fit waits in the queue
(TTFT grows) instead of slowing every running stream.

Contract. The caller (the scheduler) may assume:
  - `prefill_tokens(d, limit)` is within [0, limit], is `limit` for a step without
    decodes or without a target, and has no side effect;
  - `admits(n)` is True without an SLO, into an empty batch, and while no batch size up
    to n + 1 was measured; otherwise only when a step of n + 1 decodes and the smallest
    chunk fits the SLO by the current estimates (before any prefill was measured: when
    the decodes alone take at most `SLO_DECODE_SHARE` of it), n + 1 decodes costing at
    most the nearest smaller measured size scaled linearly; the one exception is the
    re-probe below;
  - `wave_admits(n)` is False without an SLO or before any decode step was measured;
  - the estimates change only in `observe`, apart from `admits` opening its re-probe
    window (below).
The engine must call `observe` once per finished step with what the step carried.
Refusals stop the mixed steps that would correct a wrong fit; so after
`SLO_REPROBE_STEPS` steps without one, `admits` lets one sequence start on the slope
alone, and its chunks measure the line again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tierguard.engine.config import EngineConfig

# Before any prefill was measured (a decode is running but nothing was prefilled alone
# yet, e.g. after a restart of the estimates), chunks are capped here.
UNMEASURED_CHUNK = 64
# With an ITL SLO and no prefill measured yet, the share of it the decodes alone may take.
SLO_DECODE_SHARE = 0.6
# With an ITL SLO, the smallest chunk a step with decodes still takes when the SLO leaves
# less room: the queue keeps moving (a little over the SLO) instead of starving.
SLO_MIN_TOKENS = 4
# The SLO chunk cap (AIMD): its cut after a step over the SLO, and its rise after a full one under.
SLO_BACKOFF = 0.75
SLO_PROBE_TOKENS = 2
# With an ITL SLO, a wave (sequences that start decoding together: slo_waves.py) grows while
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

    @classmethod
    def from_config(cls, config: EngineConfig) -> StepBudget:
        """The engine's budget: `--target-itl-ms`, `--prefill-share`, `--itl-slo-ms`, and the
        block size as the smallest chunk without an SLO."""
        return cls(config.target_itl_ms, min_tokens=config.block_size, prefill_share=config.prefill_share,
                   slo_ms=config.itl_slo_ms)

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
            # linear scaling of a smaller one's, so one slow step at a size cannot refuse
            # every later sequence (nothing would run at that size to heal the estimate).
            # A size not measured yet gets that scaling itself: the smaller one's time
            # leaves no room for the new row's cost, and the chunk beside it would run
            # over the SLO for its whole prompt.
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
        # them: one noisy intercept (the least certain part of a fit over small chunks)
        # would run the server one sequence at a time until restart. So after
        # SLO_REPROBE_STEPS steps without one, a sequence may start on the slope alone,
        # and its chunks measure the line again.
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
