"""The TTFT model of predicted admission: a closed form, its calibration, its online fit.

**The closed form.** An engine with chunked prefill (vLLM, SGLang, `tierguard serve`)
fills each step with one row per running decode and prefill chunks, in arrival order,
up to C tokens (its `max_num_batched_tokens`). A request whose prompt joins W prompt
tokens still to prefill ahead of it, its own included (K attended keys: a P-token prompt
attends about P²/2), while D requests decode, gets its first token after

    S    = ceil(W / max(1, C - D))                     steps
    TTFT = base + per_token W + per_key K + S (per_step + per_decode D)

`base` is what no step explains (HTTP, tokenizing, the first token's way out). It is
linear in five coefficients, so it is both cheap (five products per upstream) and fitted
by linear least squares. The features are the gate's own view: what it sent there and
what waits before the request in its queue, so whatever the view misses on average (a
partly prefilled request counted whole, a prefix-cache hit) is absorbed by the fit.

**Where the coefficients come from.** A `tierguard predict` calibration file
(`load_calibration`: the step-cost lines of `tierguard serve` or a black box), or
nothing; either way the online fit then follows the upstream's own answers.

**The online fit** (`OnlineFit`): exponentially weighted least squares, relative (each
observation weighted by 1 / its predicted TTFT², so short requests count as much as long
ones), non-negative, with a forgetting factor of 1 - 1/`window` so that it follows a
changing load mix and a prior that was wrong. per_key stays the prior's (`FIXED`). The
prior counts as `Prior.weight` observations of the size the data has in each direction,
and keeps the normal equations regular (no covariance wind-up in directions the traffic
never excites). Residuals beyond a few spreads are down-weighted (Huber). Its
uncertainty: the spread of the relative residuals (`rel_sd`, from their mean absolute
value over the last window/4 answers) and each coefficient's standard error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierguard.common.errors import TierguardError
from tierguard.predict.costmodel import nnls

TERMS = ("base", "per_token", "per_key", "per_step", "per_decode")
DEFAULT_CHUNK = 1024  # tierguard serve's max_num_batched_tokens
DEFAULT_REL_SD = 0.5  # the spread assumed before anything is known
FLOOR_S = 0.02  # relative errors are taken against at least this much TTFT
TYPICAL_DECODES = 8  # the scale of the decode feature (conditioning only)
# per_key stays the prior's: ordinary traffic cannot tell it from per_token, and a quadratic
# term fitted on short prompts extrapolates to long ones by their square (every long prompt
# would be refused, and never observed to correct it)
FIXED = np.array([0.0, 0.0, 1.0, 0.0, 0.0])
MIN_OBSERVATIONS = 5  # without a calibration, the spread is measured from this many answers on


def features(tokens: float, keys: float, decodes: float, chunk: int) -> list[float]:
    """The five features of the closed form, in TERMS order."""
    steps = math.ceil(tokens / max(1.0, chunk - decodes)) if tokens > 0 else 0
    return [1.0, float(tokens), float(keys), float(steps), float(steps * decodes)]


def keys_of(tokens: int) -> float:
    """Keys a prompt's prefill attends: each token attends those before it and itself."""
    return tokens * (tokens + 1) / 2.0


@dataclass
class Prior:
    """Coefficients (seconds, TERMS order), the engine's chunk and how sure they are."""

    coef: list[float]
    chunk: int = DEFAULT_CHUNK
    rel_sd: float = DEFAULT_REL_SD
    source: str = "none"  # "none" or the calibration file's name
    weight: float = 0.5  # pseudo-observations: a calibration weighs more than nothing

    @classmethod
    def empty(cls, chunk: int | None = None) -> Prior:
        return cls([0.0] * len(TERMS), chunk or DEFAULT_CHUNK)


def _coef(regimes: dict, name: str, path: str) -> dict[str, float]:
    line = regimes.get(name)
    if not isinstance(line, dict) or not isinstance(line.get("features"), list) \
            or not isinstance(line.get("coef"), list) or len(line["features"]) != len(line["coef"]):
        raise TierguardError(f"calibration {path}: cost line {name!r} is missing or malformed")
    try:
        return {str(f): float(c) for f, c in zip(line["features"], line["coef"], strict=True)}
    except (TypeError, ValueError):
        raise TierguardError(f"calibration {path}: cost line {name!r} holds a non-number") from None


def load_calibration(path: str, chunk: int | None = None) -> Prior:
    """The closed form's coefficients from a `tierguard predict` calibration file.

    `tierguard serve` ("tierguard": fitted on its step log): per_token and per_key are the
    prefill path's per-row and per-key costs; per_step its fixed cost (plus one chunk and
    the work between steps); per_decode a decode row at the probes' context. A black box
    ("generic"): the chunk line's prefill part; C from its policy. `chunk` overrides C
    (a tierguard calibration does not record it: the default is serve's 1024)."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as exc:
        raise TierguardError(f"calibration {path}: cannot read it ({exc.strerror})") from None
    except (ValueError, UnicodeDecodeError):
        raise TierguardError(f"calibration {path}: not a JSON file") from None
    if not isinstance(d, dict) or not isinstance(d.get("cost"), dict) or d.get("kind") not in ("tierguard", "generic"):
        raise TierguardError(f"calibration {path}: not a tierguard predict calibration "
                             "(expected 'kind' tierguard or generic and a 'cost' table)")
    regimes = d["cost"].get("regimes")
    if not isinstance(regimes, dict):
        raise TierguardError(f"calibration {path}: no cost regimes")
    plan, client = d.get("plan") or {}, d.get("client") or {}
    ctx = float(plan.get("ramp_context") or 512)  # a running decode's context, as the probes ran it
    base = (float(client.get("send_ms") or 0.0) + float(client.get("first_deliver_ms")
                                                        or client.get("deliver_ms") or 0.0)) / 1000.0
    if d["kind"] == "generic":
        line = _coef(regimes, "chunk", path)
        policy = d.get("policy") or {}
        c = chunk or int(policy.get("max_num_batched_tokens") or DEFAULT_CHUNK)
        coef = [base, line.get("chunk_tokens", 0.0), line.get("chunk_keys", 0.0),
                line.get("1", 0.0) + line.get("has_chunk", 0.0),
                line.get("token_rows", 0.0) + line.get("token_row_keys", 0.0) * ctx]
    else:
        line = _coef(regimes, "wide" if "wide" in regimes else "fused", path)
        gap = _coef(d["cost"], "gap", path) if isinstance(d["cost"].get("gap"), dict) else {}
        c = chunk or DEFAULT_CHUNK
        coef = [base, line.get("rows", 0.0), line.get("keys", 0.0),
                line.get("1", 0.0) + line.get("chunks", 0.0) + gap.get("1", 0.0),
                line.get("rows", 0.0) + line.get("keys", 0.0) * ctx + line.get("sampled", 0.0)
                + gap.get("sampled", 0.0)]
    if not all(math.isfinite(x) and x >= 0 for x in coef):
        raise TierguardError(f"calibration {path}: negative or non-finite costs")
    band = float(d.get("band") or 0.05)
    return Prior([max(0.0, x) for x in coef], c, max(0.05, min(1.0, band)), p.name, weight=8.0)


class OnlineFit:
    """TTFT ≈ coef · features, learned from observations; see the module docstring.

    Contract: `predict` is non-negative and O(1); `observe` costs a 5x5 solve and never
    raises on any finite input; before any observation the prediction is the prior's."""

    def __init__(self, prior: Prior, window: int = 100, learn: bool = True) -> None:
        self.prior = prior
        self.learn = learn
        self.forget = 1.0 - 1.0 / max(2, window)
        self.forget_error = 1.0 - 1.0 / max(10, window // 4)  # the spread follows faster than the fit
        c = prior.chunk
        self.scale = np.array([1.0, c, c * c / 2.0, 1.0, TYPICAL_DECODES], dtype=float)
        self._z0 = np.asarray(prior.coef, dtype=float) * self.scale  # seconds per scaled unit
        self._a = np.zeros((len(TERMS), len(TERMS)))
        self._nfit = 0.0  # the observations in the fit, forgetting counted
        self._b = np.zeros(len(TERMS))
        self._z = self._z0.copy()
        self._abs = 0.0  # weighted sum of absolute relative residuals
        self._w0 = 4.0  # the weight of the prior's spread
        self._bias = 0.0  # weighted sum of relative residuals
        self._n = 0.0  # their weight
        self.observations = 0

    @property
    def coef(self) -> list[float]:
        return [float(x) for x in self._z / self.scale]

    @property
    def rel_sd(self) -> float:
        """Spread of the relative residuals: 1.25 x their mean absolute value (the standard
        deviation of a normal error, less swayed by a few outliers than the rms), the
        prior's spread counting as a few observations (forgotten as they are)."""
        return (self._w0 * self.prior.rel_sd + 1.25 * self._abs) / (self._w0 + self._n)

    @property
    def rel_bias(self) -> float:
        return self._bias / self._n if self._n else 0.0

    def coef_sd(self) -> list[float]:
        """Standard error of each coefficient (seconds per unit)."""
        try:
            cov = np.linalg.inv(self._a + self._prior_matrix()) * self.rel_sd**2
        except np.linalg.LinAlgError:
            return [math.inf] * len(TERMS)
        return [float(x) for x in np.sqrt(np.maximum(np.diag(cov), 0.0)) / self.scale]

    def predict(self, x: list[float]) -> float:
        return max(0.0, sum(c * v for c, v in zip(self._z / self.scale, x, strict=True)))

    def observe(self, x: list[float], measured_s: float) -> float:
        """Learn from one request: its features when it was sent, its measured TTFT.
        Returns the relative residual against the prediction made before learning:
        (measured - predicted) / their mean, within [-2, 2] however far off it was."""
        if not (math.isfinite(measured_s) and measured_s >= 0 and all(math.isfinite(v) for v in x)):
            return 0.0
        predicted = self.predict(x)
        r = (measured_s - predicted) / max((measured_s + predicted) / 2, FLOOR_S)
        clip = max(0.25, 3.0 * self.rel_sd)
        huber = 1.0 if abs(r) <= clip else clip / abs(r)
        if self.observations >= MIN_OBSERVATIONS or self.prior.source != "none":
            # an empty prior's first answers measure how little was known, not the fit's spread
            lam_e, rc = self.forget_error, max(-clip, min(clip, r))
            self._abs = lam_e * self._abs + abs(rc)
            self._w0 *= lam_e
            self._bias = lam_e * self._bias + rc
            self._n = lam_e * self._n + 1.0
        self.observations += 1
        if not self.learn:
            return r
        lam = self.forget
        z = np.asarray(x, dtype=float) / self.scale
        w = huber / max(predicted, measured_s, FLOOR_S) ** 2
        self._a = lam * self._a + w * np.outer(z, z)
        self._b = lam * self._b + w * z * measured_s
        self._nfit = lam * self._nfit + 1.0
        self._solve()
        return r

    def _prior_matrix(self) -> np.ndarray:
        """The prior as `prior.weight` observations of the size the data has in each direction
        (whatever the scale of the TTFTs), and a trace of regularization where the traffic
        never reached (those coefficients stay at the prior's)."""
        d = np.diag(self._a)
        top = max(float(d.max()) if d.size else 0.0, 1e-12)
        return np.diag(self.prior.weight / max(self._nfit, 1.0) * d + 1e-6 * top + FIXED * 1e6 * top)

    def _solve(self) -> None:
        """min (z - zhat)' M (z - zhat) over z >= 0, M = A + P: NNLS on M's Cholesky factor."""
        p = self._prior_matrix()
        m = self._a + p
        rhs = self._b + p @ self._z0
        try:
            upper = np.linalg.cholesky(m).T  # M = U'U
            target = np.linalg.solve(upper.T, rhs)
        except np.linalg.LinAlgError:
            return
        z = nnls(upper, target)
        if np.all(np.isfinite(z)):
            self._z = z
