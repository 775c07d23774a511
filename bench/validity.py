"""Whether a benchmark run measured what it claims to, and goals judged only on valid runs.

Why one helper: every bench script can fail in ways that still yield numbers (a stream
that errored is left out of the percentiles, a tier that never got a hit makes the
"with tiers" figure the "without tiers" one, a mismatched chunk count pairs the wrong
timestamps). Each script states its preconditions with `require`; the JSON then carries
`"valid": false` and the reasons, and `goal()` reports null instead of true for a
goal measured on an invalid run.

    v = Validity()
    v.require(not errors, f"{len(errors)} requests failed: {errors[:3]}")
    v.require(disk_hits > 0, "no disk-tier hit was counted: the disk path was not exercised")
    out.update(v.as_dict())
    out["goal_met"] = v.goal(p99 < 1.25 * ref)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Validity:
    reasons: list[str] = field(default_factory=list)

    def require(self, ok: bool, reason: str) -> bool:
        """Record `reason` when `ok` is false; returns `ok` so callers can branch on it."""
        if not ok:
            self.reasons.append(reason)
        return bool(ok)

    @property
    def valid(self) -> bool:
        return not self.reasons

    def goal(self, met: bool | None) -> bool | None:
        """A goal's verdict, or None when the run is invalid (never "met" on a broken run)."""
        return bool(met) if self.valid and met is not None else None

    def as_dict(self) -> dict:
        return {"valid": self.valid, "invalid_reasons": list(self.reasons)}


def count_errors(errors: list[str], what: str = "requests") -> str:
    """A reason line for failed requests: how many, and the first few messages."""
    shown = "; ".join(e[:200] for e in errors[:3])
    return f"{len(errors)} {what} failed ({shown})"
