"""The matrix file: variants, one workload profile, the slices of R9 and the SLOs.

Why one profile for all variants: a comparison is only meaningful when every variant
receives the same prompts, lengths, sampling, limits and warm-up (R10). The matrix
therefore has exactly one `profile`; variants only say how to reach an engine.
Validation happens here, at the edge, and every error names the offending field.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tierguard.common.errors import TierguardError, read_text
from tierguard.common.units import parse_tokens

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _tokens(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a token count, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{what} must be positive, got {value}")
        return value
    try:
        return parse_tokens(str(value), what)
    except TierguardError as exc:
        raise ValueError(str(exc)) from None


def shared_prefix_len(share: float, context: int) -> int:
    """Prefix tokens of a `context`-token prompt: `share` of it, at least one, leaving one."""
    return min(context - 1, max(1, round(share * context)))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Variant(_Strict):
    """How to reach one engine: a command template that starts it, or a running server.

    In `command` (and `env`, `health_url`), `{port}` is replaced by a free loopback port
    chosen by the sweep (the engine is then reached at http://127.0.0.1:{port}),
    `{base_url}` by that URL, `{python}` by the interpreter running the sweep,
    `{workdir}` by the variant's directory inside the run directory and
    `{model_dir:NAME}` by the local model directory of `--model NAME` (tiny, smollm2, a .gguf).
    """

    name: str
    command: str | list[str] | None = None
    base_url: str | None = None
    health_url: str = "{base_url}/health"
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    start_timeout_s: float = Field(default=120.0, gt=0)
    stop_grace_s: float = Field(default=10.0, ge=0)
    warmup_requests: int = Field(default=2, ge=0)
    model: str | None = None  # overrides profile.model for this engine's served name
    description: str = ""
    # Roles the recommendation understands: reference, no-tier, host-tier, disk-prefix, fp8, naive-sync-disk.
    tags: list[str] = Field(default_factory=list)
    # Variants this one cannot truly beat (it has less memory and otherwise the same
    # settings): a boundary measured above one of them is reported as noise.
    bounded_by: list[str] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"variant name {v!r} must be 1-64 of letters, digits, '_', '.', '-'")
        return v

    @model_validator(mode="after")
    def _one_target(self) -> Variant:
        if (self.command is None) == (self.base_url is None):
            raise ValueError(f"variant {self.name!r}: give exactly one of `command` or `base_url`")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"variant {self.name!r}: base_url must start with http:// or https://")
        return self

    @property
    def managed(self) -> bool:
        """True when the sweep starts and stops this engine itself."""
        return self.command is not None


class Profile(_Strict):
    """The workload every variant receives, identical by construction."""

    endpoint: Literal["/v1/completions", "/v1/chat/completions"] = "/v1/completions"
    model: str | None = None
    tokenizer: str | None = None  # local tokenizer dir for exact lengths; "tiny" = the built-in model's
    # shared-prefix: each prompt of `context` tokens starts with one of `num_prefixes`
    # shared prefixes of round(prefix_share x context) tokens, interleaved so a prefix is
    # reused after `num_prefixes` other requests: the workload prefix tiers exist for.
    dataset: Literal["fixed", "random", "shared-prefix"] = "fixed"
    prefix_share: float = Field(default=0.75, gt=0, lt=1)
    num_prefixes: int = Field(default=2, ge=1)
    context_lengths: list[int] = Field(default_factory=lambda: [2048])
    output_len: int = 256
    range_ratio: float = Field(default=0.0, ge=0, lt=1)
    temperature: float = Field(default=0.0, ge=0)
    ignore_eos: bool = True
    seed: int = 0
    num_requests: int = Field(default=32, ge=1)
    min_rounds: int = Field(default=4, ge=1)  # each cell sends >= min_rounds x concurrency requests
    request_rate: float = math.inf
    warmup_requests: int = Field(default=0, ge=0)
    timeout_s: float = Field(default=600.0, gt=0)
    extra_bench_args: list[str] = Field(default_factory=list)

    @field_validator("context_lengths", mode="before")
    @classmethod
    def _ctx(cls, v: Any) -> list[int]:
        items = v if isinstance(v, list) else [v]
        if not items:
            raise ValueError("context_lengths must not be empty")
        return [_tokens(x, "context length") for x in items]

    @field_validator("output_len", mode="before")
    @classmethod
    def _out(cls, v: Any) -> int:
        return _tokens(v, "output_len")

    @field_validator("request_rate", mode="before")
    @classmethod
    def _rate(cls, v: Any) -> float:
        if isinstance(v, str) and v.strip().lower() in ("inf", "infinity"):
            return math.inf
        rate = float(v)
        if rate <= 0:
            raise ValueError("request_rate must be positive or 'inf'")
        return rate

    @model_validator(mode="after")
    def _prefix_fits(self) -> Profile:
        if self.dataset == "shared-prefix" and min(self.context_lengths) < 2:
            raise ValueError("shared-prefix needs context lengths of at least 2 tokens (prefix + suffix)")
        return self

    def requests_for(self, concurrency: int) -> int:
        return max(self.num_requests, self.min_rounds * concurrency)

    def prefix_len(self, context: int) -> int:
        """Shared-prefix tokens of a `context`-token prompt."""
        return shared_prefix_len(self.prefix_share, context)


class Mixed(_Strict):
    """R9's mixed slice: a constant share of long requests among short ones."""

    long_share: float = Field(default=0.05, gt=0, lt=1)
    short_len: int = 2048
    long_len: int = 32768
    concurrency: list[int] = Field(default_factory=lambda: [4])

    @field_validator("short_len", "long_len", mode="before")
    @classmethod
    def _len(cls, v: Any) -> int:
        return _tokens(v, "mixed length")


class PrefixReuse(_Strict):
    """A prefix-reuse slice: `num_prefixes` shared prefixes, interleaved, each reused by
    `requests_per_prefix` requests of `context` tokens. With more prefix tokens than the
    device pool holds, a prefix is evicted before its next use: without a tier it is
    recomputed, with a host or NVMe prefix tier it is loaded. Judged against the same SLOs,
    but reported beside the boundary, not folded into it."""

    context: int = 1024
    prefix_share: float = Field(default=0.75, gt=0, lt=1)
    num_prefixes: int = Field(default=8, ge=1)
    requests_per_prefix: int = Field(default=3, ge=2)  # >= 2, or nothing is ever reused
    concurrency: list[int] = Field(default_factory=lambda: [2])

    @field_validator("context", mode="before")
    @classmethod
    def _ctx(cls, v: Any) -> int:
        n = _tokens(v, "prefix slice context")
        if n < 2:
            raise ValueError("prefix slice context must be at least 2 tokens (prefix + suffix)")
        return n

    @property
    def prefix_len(self) -> int:
        return shared_prefix_len(self.prefix_share, self.context)

    @property
    def num_requests(self) -> int:
        return self.num_prefixes * self.requests_per_prefix


class Slices(_Strict):
    """Which of R9's slices to run. The ladder is walked for every context length,
    which is also the short-vs-long slice (equal output length for all contexts)."""

    single: bool = True
    ladder: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16])
    bisect: bool = True
    mixed: Mixed | None = None
    prefix: PrefixReuse | None = None

    @field_validator("ladder")
    @classmethod
    def _ladder(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v) or sorted(set(v)) != v:
            raise ValueError("ladder must be a strictly increasing list of concurrencies >= 1")
        return v


class SLO(_Strict):
    """p99 limits in milliseconds; a request that failed or was rejected misses them all."""

    p99_ttft_ms: float = Field(gt=0)
    p99_itl_ms: float = Field(gt=0)
    p99_tpot_ms: float | None = Field(default=None, gt=0)
    p99_e2el_ms: float | None = Field(default=None, gt=0)

    def limits(self) -> dict[str, float]:
        """Metric name (ttft, itl, tpot, e2el) -> limit in ms, only those set."""
        out = {"ttft": self.p99_ttft_ms, "itl": self.p99_itl_ms}
        if self.p99_tpot_ms is not None:
            out["tpot"] = self.p99_tpot_ms
        if self.p99_e2el_ms is not None:
            out["e2el"] = self.p99_e2el_ms
        return out


class Uncertainty(_Strict):
    bootstrap: int = Field(default=500, ge=0)  # 0: no bootstrap interval
    confidence: float = Field(default=0.9, gt=0, lt=1)
    repeats: int = Field(default=1, ge=1)  # bench runs per cell, samples pooled


class Matrix(_Strict):
    name: str = "sweep"
    variants: list[Variant]
    profile: Profile = Field(default_factory=Profile)
    slices: Slices = Field(default_factory=Slices)
    slo: SLO
    uncertainty: Uncertainty = Field(default_factory=Uncertainty)

    @model_validator(mode="after")
    def _unique(self) -> Matrix:
        if not self.variants:
            raise ValueError("the matrix needs at least one variant")
        names = [v.name for v in self.variants]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate variant names: {', '.join(dupes)}")
        for v in self.variants:
            unknown = [n for n in v.bounded_by if n not in names or n == v.name]
            if unknown:
                raise ValueError(f"variant {v.name!r}: bounded_by names no other variant: {', '.join(unknown)}")
        return self


def parse_matrix(data: Any, source: str = "matrix") -> Matrix:
    """Validate a loaded YAML/JSON document; raise TierguardError naming each bad field."""
    if not isinstance(data, dict):
        raise TierguardError(f"{source}: expected a mapping at the top level")
    try:
        return Matrix.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top)"
            problems.append(f"{where}: {err['msg']}")
        raise TierguardError(f"{source}: invalid matrix: " + "; ".join(problems)) from None


def read_matrix_text(path: str | Path) -> str:
    """The matrix file's text; not UTF-8 or unreadable: one TierguardError line."""
    return read_text(path, "matrix file")


def load_matrix(path: str | Path) -> Matrix:
    p = Path(path)
    if not p.is_file():
        raise TierguardError(f"matrix file {str(p)!r} not found")
    try:
        data = yaml.safe_load(read_matrix_text(p))
    except yaml.YAMLError as exc:
        raise TierguardError(f"{p}: not valid YAML: {str(exc).splitlines()[0]}") from None
    return parse_matrix(data, str(p))
