"""Calibration: a short run of probes per engine, fitted into a cost model, cached.

The probes are closed-loop bench runs against the real server, fixed-length prompts:

    single   one request at a time at `single_lengths` tokens (prefill cost against
             prompt length; one stream's step time at several contexts)
    ramp     `ramp_concurrency` streams at `ramp_context` tokens (step time against the
             number of running streams)

`tierguard serve` runs the probes with `--step-log`, so every step's shape and duration
is measured inside the server while the client loads it as a sweep does; the step cost
model (costmodel.py) is fitted on those steps, the work between steps on their gaps, and
the client's fixed latencies on the single requests (the step a token came from is the
last one that ended before the client saw it). The probe runs the variant's command
without its KV budget (engines.py), so variants that differ only there share one
calibration; the tiers stay, as their copies share the engine's cores. Each variant's
own EngineConfig comes from a start of its own command (the step log's header; no
request is sent).

Any other engine is a black box (`calibrate_external`): its step time against running
streams comes from the ramp's median inter-token latency, its prefill cost from the
single requests' TTFT, and its batching policy from its flags and log (engines.py).

Results are cached under the calibration directory by a fingerprint of everything that
changes them: the engine command as the probe runs it, its environment, the probe plan,
this machine (CPU model and count) and tierguard's version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierguard.common.errors import TierguardError
from tierguard.engine.api import StepShape
from tierguard.predict.costmodel import (
    REGIME_FEATURES,
    Linear,
    StepCost,
    fit_relative,
    lag1_correlation,
    normal_scores,
)
from tierguard.predict.driver import ClientTiming
from tierguard.predict.engines import (
    EngineCommand,
    Policy,
    classify,
    compute_probe_argv,
    external_policy,
    with_step_log,
)
from tierguard.sweep.matrix import Matrix, Variant

Log = Callable[[str], None]
BAND_FLOOR = 0.05  # the smallest uncertainty band: +-5 % on every cost
BAND_CEILING = 0.5
CALIBRATION_VERSION = 3
MAX_DELIVER_SAMPLES = 1000  # per-token delivery latencies kept (a random subsample beyond)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierguard" / "predict"


def machine_id() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from tierguard import __version__

    return {"cpu": cpu, "cpus": os.cpu_count(), "tierguard": __version__}


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class ProbePlan:
    single_lengths: list[int]
    ramp_context: int
    ramp_concurrency: list[int]
    output_len: int
    single_repeats: int = 2
    # Longer single requests at the shortest length: the delivery distribution's samples.
    # Its tail sets the one-stream p99 and a few hundred tokens leave it to chance.
    delivery_requests: int = 4
    delivery_output_len: int = 128

    @classmethod
    def for_matrix(cls, matrix: Matrix, max_model_len: int | None = None, ramp: list[int] | None = None,
                   output_len: int | None = None) -> ProbePlan:
        """Single requests at C/8, C/2 and C (C: the matrix's longest context), four more at
        C/8 with 128 output tokens, a ramp at C/2 up to 8 streams (or the ladder's top, if
        lower)."""
        out = output_len or min(matrix.profile.output_len, 32)
        top = max(matrix.profile.context_lengths)
        if max_model_len:
            top = min(top, max_model_len - out)
        lengths = sorted({max(16, top // 8), max(16, top // 2), top})
        ladder_top = max(matrix.slices.ladder)
        ramp = ramp or [c for c in (2, 4, 8) if c <= max(2, ladder_top)]
        delivery = cls.delivery_output_len
        if max_model_len:
            delivery = min(delivery, max_model_len - lengths[0])
        return cls(lengths, max(16, top // 2), ramp, out, delivery_output_len=max(out, delivery))

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict) -> ProbePlan:
        return cls(**d)

    def conditions(self) -> tuple[set[int], set[int]]:
        """(contexts, concurrencies) the probes ran at: the in-sample conditions."""
        return set(self.single_lengths) | {self.ramp_context}, {1, *self.ramp_concurrency}


@dataclass
class Calibration:
    kind: str  # "tierguard" (step log, our scheduler) or "generic" (black box)
    fingerprint: str
    cost: StepCost
    client: ClientTiming
    plan: ProbePlan
    band: float = BAND_FLOOR  # relative uncertainty of every cost (the prediction's band)
    policy: Policy | None = None
    conditions: dict = field(default_factory=dict)  # machine load, wall time, date

    def to_json(self) -> dict:
        return {
            "version": CALIBRATION_VERSION,
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "cost": self.cost.to_json(),
            "client": self.client.to_json(),
            "plan": self.plan.to_json(),
            "band": self.band,
            "policy": self.policy.to_json() if self.policy else None,
            "conditions": self.conditions,
        }

    @classmethod
    def from_json(cls, d: dict) -> Calibration:
        return cls(d["kind"], d["fingerprint"], StepCost.from_json(d["cost"]), ClientTiming.from_json(d["client"]),
                   ProbePlan.from_json(d["plan"]), float(d.get("band", BAND_FLOOR)),
                   Policy.from_json(d["policy"]) if d.get("policy") else None, d.get("conditions", {}))


class Cache:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)

    def get(self, kind: str, key: str) -> dict | None:
        p = self.dir / f"{kind}-{key}.json"
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return d if d.get("version", CALIBRATION_VERSION) == CALIBRATION_VERSION else None

    def put(self, kind: str, key: str, data: dict) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.dir / f"{kind}-{key}.json"
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": CALIBRATION_VERSION, **data}, indent=1))
        os.replace(tmp, p)
        return p


# ---- running probes against a real server ------------------------------------------------

@dataclass
class ProbeRun:
    phase: str  # "single", "delivery" (single requests kept for the client's latencies) or "ramp"
    context: int
    concurrency: int
    t0: float  # CLOCK_MONOTONIC of the run's start
    start: float  # first send, absolute
    end: float  # last record's end, absolute
    records: list  # RequestRecord


def probe_jobs(plan: ProbePlan, tiny_first: bool = False) -> list[tuple[str, int, int, int, int]]:
    """The probe runs in order: (phase, prompt tokens, concurrency, requests, output tokens)."""
    out = plan.output_len
    jobs = [("warm-up", 16, 1, 1, out)]  # first requests find cold caches and lazy set-up: not kept
    jobs += [("single", n, 1, plan.single_repeats, out) for n in ([16] if tiny_first else []) + plan.single_lengths]
    if plan.delivery_requests:
        jobs += [("delivery", plan.single_lengths[0], 1, plan.delivery_requests, plan.delivery_output_len)]
    jobs += [("ramp", plan.ramp_context, c, 2 * c, out) for c in plan.ramp_concurrency]
    return jobs


def run_probes(base_url: str, model: str | None, endpoint: str, tokenizer: str | None, plan: ProbePlan,
               timeout_s: float, log: Log, tiny_first: bool = False) -> list[ProbeRun]:
    from tierguard.bench.config import BenchConfig
    from tierguard.bench.runner import run_bench

    runs = []
    for i, (phase, ctx, c, n, out_len) in enumerate(probe_jobs(plan, tiny_first)):
        cfg = BenchConfig(base_url=base_url, endpoint=endpoint, model=model, dataset="fixed", input_len=ctx,
                          output_len=out_len, max_concurrency=c, num_requests=n, seed=1000 + i,
                          tokenizer=tokenizer, show_progress=False, timeout=timeout_s, ignore_eos=True,
                          temperature=0.0, max_send_lateness_ms=1e9, max_loop_lag_ms=1e9, max_client_cpu_util=1e9)
        res = run_bench(cfg)
        t0 = float(res.run_info.get("t0_monotonic", 0.0))
        recs = [r for r in res.records if r.ok]
        if not recs:
            raise TierguardError(f"calibration probe {phase} ctx {ctx} c {c}: every request failed "
                                 f"({next(iter(res.summary.get('errors') or {}), 'no answer')})")
        if phase == "warm-up":
            continue
        start = t0 + min(r.scheduled_s for r in recs)
        end = t0 + max(r.end_s or 0.0 for r in recs)
        runs.append(ProbeRun(phase, ctx, c, t0, start, end, recs))
        log(f"  probe {phase} ctx {ctx} c {c}: {len(recs)} ok, median TTFT "
            f"{statistics.median(r.ttft_ms for r in recs):.0f} ms")
    return runs


def _start(variant: Variant, argv: list[str], workdir: Path, profile, log: Log):
    from tierguard.sweep.lifecycle import Engine

    v = variant.model_copy(update={"name": variant.name, "command": argv, "base_url": None, "warmup_requests": 1})
    engine = Engine(v, workdir)
    log(f"  starting {variant.name}: {' '.join(argv[-8:])}")
    engine.start(profile)
    return engine


# ---- our engine: fit on the step log -------------------------------------------------------

def shape_of(step: dict) -> StepShape:
    return StepShape(step["token_rows"], step["token_row_keys"], step["chunks"], step["chunk_tokens"],
                     step["chunk_keys"], step["sampled"])


def fit_step_log(header: dict, steps: list[dict], runs: list[ProbeRun]) -> tuple[StepCost, ClientTiming, float]:
    """The step cost, the client's latencies and the band from probes and their steps."""
    first = min(r.start for r in runs)
    steps = sorted((s for s in steps if s["started"] >= first - 1e-3), key=lambda s: s["started"])
    # the delivery probes only measure the client's side: their steps (one stream, one
    # short context, many of them) would weigh the fit toward a shape the others cover
    delivery_windows = [(r.start, r.end) for r in runs if r.phase == "delivery"]
    busy = [s for s in steps if s["token_rows"] + s["chunk_tokens"] > 0
            and not any(lo <= s["started"] <= hi for lo, hi in delivery_windows)]
    if len(busy) < 10:
        raise TierguardError(f"calibration: only {len(busy)} steps were logged during the probes")
    ramp_windows = [(r.start, r.end) for r in runs if r.phase == "ramp"]
    gaps, raw = [], []
    for a, b in zip(steps, steps[1:], strict=False):
        if any(lo <= a["started"] and b["started"] <= hi for lo, hi in ramp_windows):
            raw.append((a["sampled"], b["started"] - a["started"] - a["duration"]))
    if raw:
        med = statistics.median(g for _, g in raw)
        gaps = [(n, g) for n, g in raw if 0 <= g <= max(0.005, 5 * med)]
    shapes, seconds = [shape_of(s) for s in busy], [s["duration"] for s in busy]
    cost = StepCost.fit(shapes, seconds, int(header.get("fused_max_rows", 0)), gaps)
    cost.rho = cost.residual_correlation(shapes, seconds)
    client = client_timing(steps, [r for r in runs if r.phase in ("single", "delivery")])
    return cost, client, band_of(cost, busy, [r for r in runs if r.phase != "delivery"])


def client_timing(steps: list[dict], singles: list[ProbeRun]) -> ClientTiming:
    """Send: from the client's send to the next step's start. Deliver: from the end of the
    step that produced a token to the token's arrival, per token (a request's first
    apart: it goes out with the response's headers). A single request runs
    alone, so its tokens are the sampled rows of the steps between its send and its last
    token, in order; a record whose count does not match (a step log with gaps) falls
    back to the last step that ended before each arrival, which can only under-count a
    late delivery."""
    starts = np.array([s["started"] for s in steps])
    ends = np.sort(np.array([s["started"] + s["duration"] for s in steps]))
    send, first, deliver = [], [], []
    for run in singles:
        for r in run.records:
            sent = run.t0 + (r.sent_s or r.scheduled_s)
            i = int(np.searchsorted(starts, sent))
            if i < len(starts):
                send.append(starts[i] - sent)
            d = token_deliveries(steps, ends, run.t0, sent, r)
            first += d[:1]
            deliver += d[1:]
    samples = sorted(deliver)
    if len(samples) > MAX_DELIVER_SAMPLES:
        samples = sorted(np.random.default_rng(0).choice(samples, MAX_DELIVER_SAMPLES, replace=False).tolist())
    return ClientTiming(statistics.median(send) if send else 0.0,
                        statistics.median(deliver or first) if deliver or first else 0.0,
                        [round(float(x), 7) for x in samples], statistics.median(first) if first else None)


def token_deliveries(steps: list[dict], ends: np.ndarray, t0: float, sent: float, rec) -> list[float]:
    """Seconds from each token's step end to its arrival (one value per token)."""
    arrivals = [t0 + t for t in rec.chunk_times_s]
    if not arrivals:
        return []
    counts = list(rec.chunk_tokens) if len(rec.chunk_tokens) == len(arrivals) else [1] * len(arrivals)
    made = [s["started"] + s["duration"] for s in steps
            if s["started"] >= sent and s["started"] + s["duration"] <= arrivals[-1] and s.get("sampled", 1) > 0]
    if len(made) == sum(counts):
        out, k = [], 0
        for t, n in zip(arrivals, counts, strict=True):
            k += n
            out += [t - made[k - 1]] * max(1, n)
        if min(out) >= 0:
            return out
    out = []
    for t in arrivals:
        j = int(np.searchsorted(ends, t, side="right")) - 1
        if j >= 0:
            out.append(t - ends[j])
    return out


def band_of(cost: StepCost, steps: list[dict], runs: list[ProbeRun]) -> float:
    """Twice the spread of the per-probe mean error of the fit, within [5 %, 50 %]: how
    far the cost of a whole run moved between probes (load, thermal state)."""
    means = []
    for r in runs:
        res = [math.log(max(s["duration"], 1e-6) / cost.step_seconds(shape_of(s)))
               for s in steps if r.start <= s["started"] <= r.end]
        if len(res) >= 5:
            means.append(statistics.fmean(res))
    spread = statistics.pstdev(means) if len(means) >= 2 else 0.0
    return round(min(BAND_CEILING, max(BAND_FLOOR, 2 * spread)), 4)


def probe_tokenizer(cmd: EngineCommand, matrix: Matrix) -> str | None:
    if matrix.profile.tokenizer:
        return matrix.profile.tokenizer
    if cmd.kind == "tierguard":
        from tierguard.predict.engines import serve_args

        model = serve_args(cmd).model
        return model if model in ("tiny", "smollm2") else None
    return None


def calibrate_ours(matrix: Matrix, variant: Variant, workdir: Path, cache: Cache, log: Log,
                   plan: ProbePlan | None = None) -> tuple[Calibration, dict]:
    """(the compute calibration, this variant's step-log header)."""
    cmd = classify(variant)
    header_key = digest({"argv": cmd.argv, "env": cmd.env, "machine": machine_id()})
    header = (cache.get("header", header_key) or {}).get("header")
    if header is None:
        engine = _start(variant, with_step_log(cmd), workdir / "config", matrix.profile, log)
        engine.stop()
        from tierguard.serve.step_log import read_step_log

        header, _ = read_step_log(workdir / "config" / "steps.jsonl")
        if not header:
            raise TierguardError(f"{variant.name}: the server wrote no step-log header")
        cache.put("header", header_key, {"header": header})
    plan = plan or ProbePlan.for_matrix(matrix, header["engine_config"]["max_model_len"])
    argv = compute_probe_argv(cmd)
    key = digest({"argv": argv, "env": cmd.env, "plan": plan.to_json(), "machine": machine_id()})
    cached = cache.get("tierguard", key)
    if cached is not None:
        log(f"{variant.name}: calibration {key} (cached)")
        return Calibration.from_json(cached), header
    log(f"{variant.name}: calibrating ({key})")
    t_start, load0 = time.monotonic(), os.getloadavg()
    pdir = workdir / "probe"
    engine = _start(variant, argv, pdir, matrix.profile, log)
    try:
        runs = run_probes(engine.base_url, engine.model, matrix.profile.endpoint, probe_tokenizer(cmd, matrix),
                          plan, matrix.profile.timeout_s, log)
    finally:
        engine.stop()
    from tierguard.serve.step_log import read_step_log

    probe_header, steps = read_step_log(pdir / "steps.jsonl")
    cost, client, band = fit_step_log(probe_header, steps, runs)
    cal = Calibration("tierguard", key, cost, client, plan, band, None, {
        "wall_s": round(time.monotonic() - t_start, 1), "loadavg": [round(x, 1) for x in (*load0, *os.getloadavg())],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": len(steps), **machine_id()})
    cache.put("tierguard", key, cal.to_json())
    log(f"{variant.name}: calibrated in {cal.conditions['wall_s']} s, band +-{band:.0%}")
    return cal, header


# ---- any other engine: black box --------------------------------------------------------------

def robust_fit(shapes: list[StepShape], seconds: list[float], max_drop: int = 2) -> Linear:
    """The decode line through a few per-run medians, leaving out up to `max_drop` runs
    the line misses by more than half (a run disturbed as a whole: the machine was busy,
    the client read late), as long as four stay."""
    pts = list(zip(shapes, seconds, strict=True))
    line = Linear.fit(REGIME_FEATURES["decode"], [s for s, _ in pts], [t for _, t in pts])
    for _ in range(max_drop):
        if len(pts) <= 4:
            break
        worst = max(pts, key=lambda p: abs(math.log(max(p[1], 1e-6) / line.mean(p[0]))))
        if abs(math.log(max(worst[1], 1e-6) / line.mean(worst[0]))) < math.log(1.5):
            break
        pts.remove(worst)
        line = Linear.fit(REGIME_FEATURES["decode"], [s for s, _ in pts], [t for _, t in pts])
    return line


def fit_black_box(runs: list[ProbeRun], policy: Policy) -> tuple[StepCost, ClientTiming, float]:
    """Decode step time from median ITL against streams; prefill from single TTFT."""
    dec_shapes, dec_t, res_runs = [], [], []
    for r in runs:
        itl = [x for rec in r.records for x in rec.itl_samples_ms()]
        if not itl:
            continue
        n = min(r.concurrency, policy.max_num_seqs)
        ctx = statistics.median((rec.prompt_tokens or rec.input_len) for rec in r.records) + 0.5 * r.records[0].output_tokens
        dec_shapes.append(StepShape(token_rows=n, token_row_keys=int(n * ctx), sampled=n))
        dec_t.append(statistics.median(itl) / 1e3)
        res_runs.append((dec_shapes[-1], np.asarray(itl) / 1e3))
    if len(dec_t) < 2:
        raise TierguardError("calibration: the probes gave too few inter-token latencies to fit")
    decode = robust_fit(dec_shapes, dec_t)
    residuals = []
    for shape, itl in res_runs:
        residuals += np.log(np.maximum(itl, 1e-6) / decode.mean(shape)).tolist()
    if residuals:
        arr = np.asarray(residuals)
        arr -= np.log(np.mean(np.exp(arr)))
        decode.residuals = [round(float(x), 5) for x in arr[:2000]]
    a0 = decode.coef[0]
    rows, ys = [], []
    budget = max(1, policy.max_num_batched_tokens)
    for r in runs:
        if r.phase != "single":
            continue
        for rec in r.records:
            n = rec.prompt_tokens or rec.input_len
            chunks, tokens, keys, done = 0, 0, 0, 0
            while done < n:
                k = min(budget, n - done)
                chunks, tokens, keys, done = chunks + 1, tokens + k, keys + k * done + k * (k + 1) // 2, done + k
            rows.append([1.0, chunks, tokens, keys])
            ys.append(rec.ttft_ms / 1e3 - chunks * a0)
    a = np.asarray(rows, dtype=float)
    y = np.maximum(np.asarray(ys, dtype=float), 0.0)
    scale = np.maximum(a.max(axis=0), 1e-9)
    coef = fit_relative(a / scale, y) / scale
    lag, pf, p1, p2 = (float(c) for c in coef)
    chunk = Linear(REGIME_FEATURES["chunk"], [*decode.coef, pf, p1, p2], decode.residuals, len(ys))
    cost = StepCost({"decode": decode, "chunk": chunk}, 0, True, None, lag1_correlation(normal_scores(residuals)))
    means = [float(np.mean(np.log(np.maximum(itl, 1e-6) / decode.mean(s)))) for s, itl in res_runs]
    band = min(BAND_CEILING, max(BAND_FLOOR, 2 * (statistics.pstdev(means) if len(means) > 1 else 0.0)))
    return cost, ClientTiming(lag, 0.0), round(band, 4)


def calibrate_external(matrix: Matrix, variant: Variant, workdir: Path, cache: Cache, log: Log,
                       plan: ProbePlan | None = None) -> Calibration:
    cmd = classify(variant)
    static = external_policy(cmd)
    # a black box's tokens cannot be matched to its steps: no delivery samples to gather
    plan = plan or dataclasses.replace(ProbePlan.for_matrix(matrix, static.max_model_len), delivery_requests=0)
    key = digest({"argv": cmd.argv, "env": cmd.env, "base_url": variant.base_url, "plan": plan.to_json(),
                  "machine": machine_id()})
    cached = cache.get("generic", key)
    if cached is not None:
        log(f"{variant.name}: calibration {key} (cached)")
        return Calibration.from_json(cached)
    log(f"{variant.name}: calibrating {cmd.kind} as a black box ({key})")
    t_start, load0 = time.monotonic(), os.getloadavg()
    from tierguard.sweep.lifecycle import Engine

    engine = Engine(variant, workdir / "probe")
    engine.start(matrix.profile)
    try:
        runs = run_probes(engine.base_url, engine.model, matrix.profile.endpoint, matrix.profile.tokenizer, plan,
                          matrix.profile.timeout_s, log, tiny_first=True)
    finally:
        engine.stop()
    try:
        log_text = (workdir / "probe" / "engine.log").read_text(errors="replace")
    except OSError:
        log_text = ""
    policy = external_policy(cmd, log_text)
    cost, client, band = fit_black_box(runs, policy)
    cal = Calibration("generic", key, cost, client, plan, band, policy, {
        "wall_s": round(time.monotonic() - t_start, 1), "loadavg": [round(x, 1) for x in (*load0, *os.getloadavg())],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "engine": cmd.kind, **machine_id()})
    cache.put("generic", key, cal.to_json())
    log(f"{variant.name}: calibrated in {cal.conditions['wall_s']} s, band +-{band:.0%}")
    return cal
