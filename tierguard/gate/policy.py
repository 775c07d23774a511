"""Admission policy and gate settings: one dataclass, validated once at the edge.

Why one place: the same options come from CLI flags, from a TOML/YAML config file and
from `tierguard serve`; validating them here means an invalid value is refused at start
with a message naming the option, never discovered under load.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from tierguard.common.errors import TierguardError, read_text
from tierguard.common.redact import redact_url

OVERFLOW_ACTIONS = ("reject", "downgrade", "async")
PRIORITIES = ("interactive", "batch")


@dataclass
class AdmissionPolicy:
    """What the admission controller enforces.

    Invariants after `validate()`: every limit is positive; `max_long <= max_concurrency` (clamped);
    `overflow` is one of OVERFLOW_ACTIONS.
    """

    max_concurrency: int = 64  # requests running upstream at once, all classes together
    long_threshold: int = 8192  # input tokens at or above this make a request "long"
    max_long: int = 4  # long requests running at once
    max_queue: int = 64  # waiting requests per class (async jobs are not counted)
    max_queue_wait_ms: float = 2000.0  # a queued request never waits longer; then 429
    overflow: str = "reject"  # what a full queue does: reject (429) | downgrade | async (202)
    max_input_tokens: int | None = None  # hard cap on input; above it chat is trimmed, else 400
    downgrade_reserve_tokens: int = 64  # headroom left below the limit after trimming

    def validate(self) -> AdmissionPolicy:
        for name in ("max_concurrency", "long_threshold", "max_long", "max_queue"):
            _positive_int(getattr(self, name), name)
        if not (isinstance(self.max_queue_wait_ms, (int, float)) and self.max_queue_wait_ms > 0
                and math.isfinite(self.max_queue_wait_ms)):
            raise TierguardError(f"max_queue_wait_ms must be a positive number, got {self.max_queue_wait_ms!r}")
        # max_long above max_concurrency is harmless but meaningless: the total limit binds first
        self.max_long = min(self.max_long, self.max_concurrency)
        if self.overflow not in OVERFLOW_ACTIONS:
            raise TierguardError(f"overflow must be one of {', '.join(OVERFLOW_ACTIONS)}, got {self.overflow!r}")
        if self.max_input_tokens is not None:
            _positive_int(self.max_input_tokens, "max_input_tokens")
        if not isinstance(self.downgrade_reserve_tokens, int) or self.downgrade_reserve_tokens < 0:
            raise TierguardError("downgrade_reserve_tokens must be a whole number >= 0")
        return self


@dataclass
class GateSettings:
    """Everything `tierguard gate` needs beyond the admission policy."""

    upstream: str = ""
    host: str = "127.0.0.1"
    port: int = 8080
    tokenizer: str | None = None  # local directory holding tokenizer.json
    api_keys: list[str] = field(default_factory=list, repr=False)  # never printed
    upstream_api_key: str | None = field(default=None, repr=False)
    log: str | None = None  # JSONL request log
    log_prompts: bool = False  # prompt text stays out of the log unless asked for
    jobs_dir: str | None = None  # None: state_dir()/jobs
    job_ttl_s: float = 86400.0  # finished jobs (prompts, answers) are deleted this long after they finish
    encrypt_key_file: str | None = None  # AES-256-GCM key for job files (common/crypto.py)
    encrypt_old_key_file: str | None = None  # a previous key: read-only, for a rotation
    async_workers: int = 4
    # async-job quotas (job_quota.py): pending jobs and bytes on disk, in total and per API key
    async_max_pending: int = 1024
    async_max_pending_per_key: int = 64
    async_max_bytes: int = 4096 * 1024**2
    async_max_bytes_per_key: int = 512 * 1024**2
    connect_timeout_s: float = 3.0
    first_byte_timeout_s: float = 60.0
    read_timeout_s: float = 60.0  # longest silence from the upstream mid-stream
    total_timeout_s: float = 600.0
    body_timeout_s: float = 10.0  # a client must send its whole body within this
    header_timeout_s: float = 10.0  # ... and its request headers within this
    slow_reader_bytes: int = 1024 * 1024  # unread output that ends a stream (its slot is freed)
    max_body_bytes: int | None = None  # None: from max_model_len and the tokenizer, else 8 MiB
    max_model_len: int | None = None  # None: the upstream's /v1/models says, if it does
    tokenizer_workers: int = 2  # processes counting tokens off the event loop (--tokenizer)
    tokenizer_queue: int = 32  # counts waiting or running at most; more get 503
    upstream_pool: int = 1024  # connections kept to the upstream
    exact_token_count: bool = False  # count every request with the tokenizer (no byte bound)
    # Prefix-cache isolation (isolation.py): "shared" forwards bodies as they came;
    # "per-key" sets a `cache_salt` per API key, so keys share no cached prefix.
    cache_isolation: str = "shared"
    # X-Tierguard-Replica / X-Tierguard-Route on responses: where a request went and why
    # ("prefix_hit"). Under shared caching that says whether another client sent the same
    # opening text, so off unless every client may know it; the request log has both.
    route_headers: bool = False
    # ---- a fleet of upstreams (docs/fleet.md) ----
    upstreams: list[str] = field(default_factory=list)  # every replica; `upstream` is the first
    route: str = "prefix"  # prefix | least-loaded | round-robin (one upstream: always that one)
    route_beta: float = 0.5  # prefix routing: score = matched share - beta x relative load
    route_imbalance: int = 8  # a replica this many requests above the least loaded one is overloaded
    route_index_entries: int = 65536  # prefix chunks remembered (LRU), all replicas together
    health_interval_s: float = 1.0  # each replica's /health probe and /metrics scrape
    eject_after: int = 3  # consecutive timeouts / 502 / 504 that eject a replica (refused: at once)
    # ---- limits shared with other gates through Redis ----
    shared_state: str | None = None  # redis://host:port/db or redis+cluster://...; None: this process's own
    shared_prefix: str = "tierguard:gate"  # key prefix: one per fleet of gates
    lease_ms: int = 5000  # a slot of a gate that stops renewing (killed) frees after this
    shared_timeout_ms: float = 100.0  # any Redis call slower than this counts as Redis down
    shared_gates: int = 1  # gates assumed at least when dividing the limits while Redis is down
    # ---- predicted-TTFT admission (docs/fleet.md; tierguard/gate/ttft_options.py) ----
    admission: str = "static"  # static: the limits decide | predicted: each class's TTFT SLO
    ttft_slo_ms: str | dict | None = None  # "interactive=1000,batch=20000" (the defaults)
    ttft_calibration: list[str] = field(default_factory=list)  # tierguard predict files: FILE, N=FILE, URL=FILE
    ttft_chunk_tokens: int | None = None  # the engine's tokens per step where no calibration says (1024)
    ttft_online: bool | str = True  # keep learning the costs from the upstreams' answers
    ttft_window: int = 100  # answers the online fit remembers (forgetting factor 1 - 1/window)
    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)

    def validate(self) -> GateSettings:
        urls = [str(u) for u in (self.upstreams or [self.upstream])]
        self.upstreams = [_base_url(u) for u in urls]
        if len(set(self.upstreams)) != len(self.upstreams):
            raise TierguardError(f"--upstream given twice for the same URL: {', '.join(map(redact_url, self.upstreams))}")
        self.upstream = self.upstreams[0]
        from tierguard.gate.routing import ROUTES

        if self.route not in ROUTES:
            raise TierguardError(f"--route must be one of {', '.join(ROUTES)}, got {self.route!r}")
        for name in ("route_beta", "health_interval_s", "lease_ms", "shared_timeout_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and name != "route_beta"):
                raise TierguardError(f"{name} must be a {'non-negative' if name == 'route_beta' else 'positive'} "
                                     f"number, got {value!r}")
        for name in ("route_index_entries", "eject_after", "shared_gates"):
            _positive_int(getattr(self, name), name)
        if isinstance(self.route_imbalance, bool) or not isinstance(self.route_imbalance, int) \
                or self.route_imbalance < 0:
            raise TierguardError(f"route_imbalance must be a whole number >= 0, got {self.route_imbalance!r}")
        if self.shared_state is not None:
            from tierguard.common.redis_client import parse_redis_url

            try:
                parse_redis_url(str(self.shared_state))
            except ValueError as e:
                raise TierguardError(f"--shared-state must be a redis:// URL: {e}") from None
            if not self.shared_prefix or "{" in self.shared_prefix or "}" in self.shared_prefix:
                raise TierguardError(f"--shared-prefix must be non-empty and without braces (it is the keys' "
                                     f"hash tag), got {self.shared_prefix!r}")
            if self.lease_ms < 3 * self.shared_timeout_ms:
                raise TierguardError(f"--lease-ms {self.lease_ms:g} is too short for --shared-timeout-ms "
                                     f"{self.shared_timeout_ms:g}: renewals every lease/3 must fit in a lease")
        if not (0 <= int(self.port) <= 65535):
            raise TierguardError(f"port must be in 0..65535, got {self.port}")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "read_timeout_s", "total_timeout_s",
                     "body_timeout_s", "header_timeout_s", "job_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise TierguardError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("async_workers", "upstream_pool", "tokenizer_workers", "tokenizer_queue", "slow_reader_bytes"):
            _positive_int(getattr(self, name), name)
        for name in ("max_body_bytes", "max_model_len"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), name)
        self.job_limits()
        if self.encrypt_old_key_file is not None and self.encrypt_key_file is None:
            raise TierguardError("--encrypt-old-key-file needs --encrypt-key-file (the key new files are sealed with)")
        from tierguard.common.crypto import Key
        from tierguard.common.peers import PeerLimits

        for path in (self.encrypt_key_file, self.encrypt_old_key_file):
            if path is not None:
                Key.from_file(path)  # unreadable, loose or malformed: refused now, before anything starts
        PeerLimits(header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
                   slow_reader_bytes=self.slow_reader_bytes).validate()
        if self.jobs_dir is None:
            self.jobs_dir = str(state_dir() / "jobs")
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise TierguardError(f"--tokenizer {self.tokenizer!r}: no tokenizer.json in that directory")
        if not isinstance(self.exact_token_count, bool):
            raise TierguardError(f"exact_token_count must be true or false, got {self.exact_token_count!r}")
        if any(not k for k in self.api_keys):
            raise TierguardError("an API key is empty")
        from tierguard.gate.isolation import check_mode

        check_mode(self.cache_isolation, bool(self.api_keys))
        if not isinstance(self.route_headers, bool):
            raise TierguardError(f"route_headers must be true or false, got {self.route_headers!r}")
        self.policy.validate()
        from tierguard.gate.ttft_options import ADMISSIONS, options_from

        if self.admission not in ADMISSIONS:
            raise TierguardError(f"--admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        if self.admission == "predicted":
            options_from(self)  # calibration files read and checked now, before anything starts
        return self

    def job_limits(self):
        """The async-job quotas, validated (a bad one names its option)."""
        from tierguard.gate.job_quota import JobLimits

        return JobLimits(max_pending=self.async_max_pending, max_pending_per_key=self.async_max_pending_per_key,
                         max_bytes=self.async_max_bytes, max_bytes_per_key=self.async_max_bytes_per_key).validate()


def _base_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise TierguardError(f"--upstream must be an http(s) URL, got {redact_url(url)!r}")
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def state_dir() -> Path:
    """$XDG_STATE_HOME/tierguard, or ~/.local/state/tierguard (the XDG default)."""
    base = os.environ.get("XDG_STATE_HOME") or ""
    root = Path(base) if Path(base).is_absolute() else Path.home() / ".local" / "state"
    return root / "tierguard"


def _positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TierguardError(f"{name} must be a positive whole number, got {value!r}")


POLICY_KEYS = {f.name for f in fields(AdmissionPolicy)}
SETTINGS_KEYS = {f.name for f in fields(GateSettings)} - {"policy", "api_keys"} | {"api_key", "api_key_file"}


def load_config(path: str) -> dict:
    """Read a TOML or YAML file into a flat {option: value} dict with underscore keys.

    Unknown keys are refused so a typo never silently keeps a default.
    """
    p = Path(path)
    if not p.is_file():
        raise TierguardError(f"config file {path!r} not found")
    text = read_text(p, "config file")
    try:
        if p.suffix.lower() == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise TierguardError("TOML config files need Python 3.11+; use a .yaml file") from None

            data = tomllib.loads(text)
        elif p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise TierguardError(f"config file {path!r}: use a .toml, .yaml or .yml file")
    except TierguardError:
        raise
    except Exception as exc:  # parser errors differ per format; report them uniformly
        raise TierguardError(f"config file {path!r} is not valid: {exc}") from None
    if not isinstance(data, dict):
        raise TierguardError(f"config file {path!r} must hold a table of options")
    flat: dict = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in ("policy", "gate"):  # optional [policy]/[gate] sections
            for k, v in value.items():
                flat[str(k).replace("-", "_")] = v
        else:
            flat[str(key).replace("-", "_")] = value
    unknown = sorted(set(flat) - POLICY_KEYS - SETTINGS_KEYS)
    if unknown:
        raise TierguardError(f"config file {path!r}: unknown option(s) {', '.join(unknown)}")
    return flat


def build_settings(options: dict) -> GateSettings:
    """Merge resolved options (config overlaid by flags) into validated settings."""
    opts = {k: v for k, v in options.items() if v is not None}
    policy = AdmissionPolicy(**{k: opts[k] for k in POLICY_KEYS if k in opts})
    keys: list[str] = []
    if "api_key" in opts:
        keys.append(str(opts["api_key"]))
    if "api_key_file" in opts:
        keys.extend(_read_keys(str(opts["api_key_file"])))
    plain = {k: opts[k] for k in SETTINGS_KEYS - {"api_key", "api_key_file"} if k in opts}
    if isinstance(plain.get("upstream"), list):  # several --upstream flags, or a list in the config file
        plain["upstreams"] = [str(u) for u in plain.pop("upstream")]
        if not plain["upstreams"]:
            raise TierguardError("--upstream URL is required")
    return GateSettings(**plain, api_keys=keys, policy=policy).validate()


def _read_keys(path: str) -> list[str]:
    """One key per line (blank lines and # comments skipped), from a file only its owner can
    read: the same check as the encryption key files (`read_private_file`)."""
    from tierguard.common.crypto import read_private_file

    try:
        lines = read_private_file(path, "API key file").decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise TierguardError(f"API key file {path!r} is not UTF-8 text") from None
    keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not keys:
        raise TierguardError(f"API key file {path!r} holds no key")
    return keys
