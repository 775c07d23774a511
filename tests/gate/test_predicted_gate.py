"""`tierguard gate --admission predicted` in front of a real upstream whose TTFT is known.

The upstream (tests/gate/cost_server.py) prefills in 512-token steps at 0.2 ms a token and
2 ms a step: a lone 1024-token prompt's first token leaves 208 ms after it arrives, and
that is the floor of anything measured on a busy machine. Its own records (`/truth`)
say when each request arrived and when its first token left, so the checks compare the
gate's predictions with what the server did, never with a fixed time.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import statistics

import aiohttp

from tests.gate.cost_server import Costs, CostServer
from tests.gate.helpers import GateProcess, metric, run
from tierguard.gate.ttft_model import TERMS, features, keys_of

COSTS = Costs(per_token_ms=0.2, per_step_ms=2.0, per_decode_ms=0.5, chunk=512)
LONE_1024_S = (1024 * COSTS.per_token_ms + 2 * COSTS.per_step_ms) / 1000  # 0.208 s
ROUND = (128, 512, 1024)


def prompt(rid: str, tokens: int) -> str:
    return " ".join([rid] + ["w"] * (tokens - 1))


async def ask(s: aiohttp.ClientSession, url: str, rid: str, tokens: int, priority: str = "interactive") -> dict:
    body = {"model": "m", "prompt": prompt(rid, tokens), "stream": True, "max_tokens": 4}
    async with s.post(url + "/v1/completions", json=body, headers={"X-Tierguard-Class": priority}) as r:
        out = {"id": rid, "status": r.status, "headers": dict(r.headers)}
        out["body"] = await r.read()
    return out


async def rounds(s: aiohttp.ClientSession, url: str, tag: str, n: int) -> list[dict]:
    out = []
    for i in range(n):
        out += await asyncio.gather(*(ask(s, url, f"{tag}{i}-{j}", t) for j, t in enumerate(ROUND)))
    return out


async def lone_prediction(s: aiohttp.ClientSession, url: str, tokens: int = 1024) -> float:
    """What the gate's fit says a lone prompt costs, from the coefficients on /metrics."""
    coef = [await metric(s, url, "tierguard_gate_ttft_model_coefficient", term=t) for t in TERMS]
    return sum(c * x for c, x in zip(coef, features(tokens, keys_of(tokens), 0, COSTS.chunk), strict=True))


async def short_share(s: aiohttp.ClientSession, url: str) -> float:
    """The share of answers whose TTFT the gate predicted short (from its signed error histogram)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    name = "tierguard_gate_ttft_prediction_error_seconds_bucket"
    counts = {le: float(v) for le, v in re.findall(name + r'\{le="([^"]+)",stage="dispatch"[^}]*\} (\S+)', text)}
    return counts["0.0"] / counts["+Inf"] if counts.get("+Inf") else 0.0


async def truth(s: aiohttp.ClientSession, upstream: str) -> dict[str, dict]:
    async with s.get(upstream + "/truth") as r:
        return {t["id"]: t for t in (await r.json())["requests"]}


def test_the_gate_learns_the_cost_says_no_before_a_miss_and_keeps_the_place_of_who_retries(tmp_path):
    async def go(gate: str, upstream: str) -> None:
        async with aiohttp.ClientSession() as s:
            assert await lone_prediction(s, gate) == 0.0  # no calibration: it knows nothing yet
            learned = await rounds(s, gate, "learn", 8)
            assert all(r["status"] == 200 for r in learned)  # light load: nothing is refused
            assert await lone_prediction(s, gate) >= 0.8 * LONE_1024_S  # learned up to the true cost
            done = await truth(s, upstream)
            # and predicts what the server then did: over the last three rounds, the error relative
            # to the true TTFT, or to a lone 1024-token prompt's where the truth is shorter (a
            # 128-token prompt's few ms are mostly the machine's noise, not the model's)
            last = [r for r in learned if r["id"].startswith(("learn5", "learn6", "learn7"))]
            errors = []
            for r in last:
                true_s = done[r["id"]]["first"] - done[r["id"]]["arrival"]
                predicted_s = float(r["headers"]["X-Tierguard-Predicted-TTFT-Ms"]) / 1000
                errors.append(round(abs(predicted_s - true_s) / max(true_s, LONE_1024_S), 3))
            assert statistics.median(errors) < 0.35, errors

            burst = await asyncio.gather(*(ask(s, gate, f"burst{j}", 1024) for j in range(8)))
            ok = [r for r in burst if r["status"] == 200]
            refused = [r for r in burst if r["status"] == 429]
            assert ok and refused and len(ok) + len(refused) == len(burst)  # 8 x 208 ms > 1 s
            waits = []
            for r in refused:
                h = r["headers"]
                wait_ms, ttft_ms = float(h["X-Tierguard-Predicted-Wait-Ms"]), float(h["X-Tierguard-Predicted-TTFT-Ms"])
                assert int(h["Retry-After"]) == max(1, math.ceil(wait_ms / 1000 - 1e-6))
                assert ttft_ms > 0.5 * 1000 and wait_ms > 0  # over the SLO with its margin (2 spreads)
                assert json.loads(r["body"])["error"]["type"] == "rate_limit_exceeded"
                waits.append(wait_ms)
            waits.sort()  # each refusal waits for the places booked before it too: a prompt's worth more
            assert all(b - a >= 0.5 * LONE_1024_S * 1000 for a, b in zip(waits, waits[1:], strict=False)), waits

            async def retry(r: dict) -> list[dict]:  # as a client does: wait as told, send it again
                answers = [r]
                while answers[-1]["status"] == 429 and len(answers) <= 3:
                    await asyncio.sleep(int(answers[-1]["headers"]["Retry-After"]))
                    answers.append(await ask(s, gate, r["id"], 1024))
                return answers[1:]

            retried = await asyncio.gather(*(retry(r) for r in refused))
            assert [a[-1]["status"] for a in retried] == [200] * len(refused)  # their places were kept
            assert sum(len(a) for a in retried) <= 1.5 * len(refused)  # mostly at the first retry
            assert await metric(s, gate, "tierguard_gate_decisions_total", reason="booked_retry") == len(refused)
            assert await metric(s, gate, "tierguard_gate_ttft_model_observations_total") >= len(learned)

    with CostServer(COSTS) as up, GateProcess(up.url, "--admission", "predicted", "--ttft-chunk-tokens", "512",
                                              "--ttft-slo-ms", "interactive=1000", jobs_dir=tmp_path / "jobs") as g:
        run(go(g.url, up.url))


def calibration(path, scale: float) -> str:
    """A black-box calibration of the cost server, its costs times `scale`, in tierguard predict's
    format (test_predicted_admission.py checks the format against predict's own classes)."""
    from tierguard.predict.costmodel import REGIME_FEATURES, Linear, StepCost
    from tierguard.predict.engines import Policy

    ms = 1e-3 * scale
    decode = Linear(REGIME_FEATURES["decode"], [COSTS.per_step_ms * ms, COSTS.per_decode_ms * ms, 0.0])
    chunk = Linear(REGIME_FEATURES["chunk"], [*decode.coef, 0.0, COSTS.per_token_ms * ms, 0.0])
    cost = StepCost({"decode": decode, "chunk": chunk}, generic=True)
    path.write_text(json.dumps({
        "version": 3, "kind": "generic", "fingerprint": "cost-server", "cost": cost.to_json(),
        "client": {"send_ms": 0.0, "deliver_ms": 0.0, "first_deliver_ms": None, "deliver_samples_ms": []},
        "plan": {"single_lengths": [128, 512, 1024], "ramp_context": 512, "ramp_concurrency": [2, 4],
                 "output_len": 8}, "band": 0.05, "policy": Policy(max_num_batched_tokens=COSTS.chunk).to_json(),
        "conditions": {}}))
    return str(path)


def test_a_calibration_wrong_by_2x_is_corrected_online_and_its_error_shows(tmp_path):
    half = calibration(tmp_path / "half.json", 0.5)

    async def go(gate: str) -> None:
        async with aiohttp.ClientSession() as s:
            assert abs(await lone_prediction(s, gate) - LONE_1024_S / 2) < 0.01  # the file's costs: half the truth
            assert all(r["status"] == 200 for r in await rounds(s, gate, "r", 6))
            assert await lone_prediction(s, gate) >= 0.8 * LONE_1024_S  # moved from half the truth to about it
            assert await short_share(s, gate) >= 3 / 18  # the first predictions were short, and /metrics says so
            assert await metric(s, gate, "tierguard_gate_ttft_model_observations_total", source="half.json") == 18

    with CostServer(COSTS) as up, GateProcess(up.url, "--admission", "predicted", "--ttft-calibration", half,
                                              jobs_dir=tmp_path / "jobs") as g:
        run(go(g.url))
