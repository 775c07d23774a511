"""Benchmark configuration: one dataclass, validated at the edge.

`BenchConfig` is the whole input of a run; `run.json` stores it verbatim. Validation
raises `TierguardError` with a message naming the flag, so the CLI never shows a
traceback and `tierguard sweep` gets the same checks through the Python API.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from tierguard.common.errors import TierguardError

DATASETS = ("random", "fixed", "mixed", "shared-prefix", "sessions", "trace")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class SLO:
    """Per-request service-level objectives in milliseconds; None means "not checked"."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def any(self) -> bool:
        return any(v is not None for v in asdict(self).values())


def parse_slo(text: str | None) -> SLO:
    """Parse "ttft=500,itl=50,tpot=40,e2el=20000" (milliseconds)."""
    slo = SLO()
    if not text:
        return slo
    for part in str(text).split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or f"{key}_ms" not in asdict(slo):
            raise TierguardError(f"invalid --slo item {part!r}: expected ttft=MS, itl=MS, tpot=MS or e2el=MS")
        value = value.strip()
        value = value[:-2] if value.endswith("ms") else value
        try:
            ms = float(value)
        except ValueError:
            raise TierguardError(f"invalid --slo value {part!r}: expected milliseconds") from None
        if not ms > 0:
            raise TierguardError(f"invalid --slo value {part!r}: must be positive")
        setattr(slo, f"{key}_ms", ms)
    return slo


@dataclass
class Window:
    """Warm-up or cool-down exclusion: a number of requests or a number of seconds."""

    requests: int = 0
    seconds: float = 0.0


def parse_window(text: str | int | float | None, what: str) -> Window:
    """"10" → the first/last 10 requests; "5s" → those scheduled in the first/last 5 s."""
    if text is None or str(text).strip() in ("", "0"):
        return Window()
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s?)\s*", str(text))
    if not m:
        raise TierguardError(f"invalid {what} {text!r}: expected a request count like 10 or seconds like 5s")
    if m.group(2):
        return Window(seconds=float(m.group(1)))
    if float(m.group(1)) != int(float(m.group(1))):
        raise TierguardError(f"invalid {what} {text!r}: a request count must be whole (use 5s for seconds)")
    return Window(requests=int(float(m.group(1))))


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    dataset: str = "random"
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_requests: int | None = None  # None: 100, or as many as --duration needs
    duration: float | None = None
    warmup: str = "0"
    cooldown: str = "0"
    seed: int = 0
    tokenizer: str | None = None
    slo: SLO = field(default_factory=SLO)
    output_dir: str | None = None
    workers: int = 1
    ignore_eos: bool = True
    timeout: float = 300.0
    temperature: float = 0.0
    # dataset-specific
    long_share: float = 0.05
    long_input_len: int = 32768
    num_prefixes: int = 4
    prefix_len: int = 1024
    requests_per_prefix: int = 8
    num_sessions: int = 8
    turns: int = 4
    trace: str | None = None
    # presentation / self-check
    show_progress: bool = True
    http_client: str = "auto"  # auto: raw asyncio client for http://, aiohttp for https://; or "aiohttp"
    scrape_interval_s: float = 1.0
    max_send_lateness_ms: float = 10.0  # p99 beyond this flags the run as distorted
    max_loop_lag_ms: float = 10.0
    max_client_cpu_util: float = 0.9  # of one core, per worker process

    @property
    def closed_loop(self) -> bool:
        """Rate inf with a concurrency limit: each request is due when a slot opens."""
        return math.isinf(self.request_rate) and self.max_concurrency is not None and self.dataset != "trace"

    @property
    def auth_headers(self) -> dict[str, str]:
        """The Authorization header for every request to the server (empty without a key)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def validate(self) -> BenchConfig:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise TierguardError(msg)

        need(self.base_url.startswith(("http://", "https://")), f"--base-url {self.base_url!r} must start with http:// or https://")
        need(self.endpoint in ENDPOINTS, f"--endpoint {self.endpoint!r} must be one of {', '.join(ENDPOINTS)}")
        need(self.http_client in ("auto", "aiohttp"), f"--http-client {self.http_client!r} must be auto or aiohttp")
        need(self.dataset in DATASETS, f"--dataset {self.dataset!r} must be one of {', '.join(DATASETS)}")
        need(self.input_len > 0, f"--input-len must be positive, got {self.input_len}")
        need(self.output_len > 0, f"--output-len must be positive, got {self.output_len}")
        need(0.0 <= self.range_ratio < 1.0, f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        need(self.request_rate > 0, f"--request-rate must be positive or inf, got {self.request_rate}")
        need(self.burstiness > 0, f"--burstiness must be positive, got {self.burstiness}")
        need(self.max_concurrency is None or self.max_concurrency > 0,
             f"--max-concurrency must be positive, got {self.max_concurrency}")
        need(self.num_requests is None or self.num_requests > 0, f"--num-requests must be positive, got {self.num_requests}")
        need(self.duration is None or self.duration > 0, f"--duration must be positive, got {self.duration}")
        need(self.workers >= 1, f"--workers must be at least 1, got {self.workers}")
        need(self.max_concurrency is None or self.max_concurrency >= self.workers,
             "--max-concurrency must be at least --workers (each worker needs a slot)")
        need(self.timeout > 0, f"--timeout must be positive, got {self.timeout}")
        need(0.0 <= self.long_share <= 1.0, f"--long-share must be in [0, 1], got {self.long_share}")
        need(self.long_input_len > 0 and self.prefix_len > 0, "--long-input-len and --prefix-len must be positive")
        need(self.num_prefixes > 0 and self.requests_per_prefix > 0, "--num-prefixes and --requests-per-prefix must be positive")
        need(self.num_sessions > 0 and self.turns > 0, "--num-sessions and --turns must be positive")
        need(self.dataset != "trace" or bool(self.trace), "--dataset trace needs --trace FILE")
        need(not (math.isinf(self.request_rate) and self.max_concurrency is None and self.duration is not None
                  and self.dataset != "trace"),
             "--duration with --request-rate inf needs --max-concurrency (otherwise every request is due at once)")
        parse_window(self.warmup, "--warmup")
        parse_window(self.cooldown, "--cooldown")
        return self

    def to_json(self) -> dict:
        d = asdict(self)
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        if self.api_key:
            d["api_key"] = "***"  # never write secrets to run.json
        return d
