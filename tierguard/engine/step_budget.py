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
Policy only: the scheduler asks, the engine reports each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Before any prefill was measured (a decode is running but nothing was prefilled alone
# yet, e.g. after a restart of the estimates), chunks are capped here.
UNMEASURED_CHUNK = 64


@dataclass
class StepBudget:
    target_ms: float = 0.0  # 0: no limit
    min_tokens: int = 16
    prefill_share: float = 1.0  # prefill time allowed per step, as a fraction of the decode time
    alpha: float = 0.25  # weight of the newest step in the moving averages
    ms_per_prefill_token: float | None = None
    decode_ms: dict[int, float] = field(default_factory=dict)  # decode-only step time by batch size

    @property
    def enabled(self) -> bool:
        return self.target_ms > 0

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
        room = max(self.target_ms, (1.0 + self.prefill_share) * decode) - decode
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
