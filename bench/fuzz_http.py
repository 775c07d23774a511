"""Fuzz serve's and the gate's routes and the engine's parameters; print the counts.

The same harness and seeded Hypothesis strategy as tests/serve/test_fuzz_http.py, for
any number of cases: generated JSON bodies, odd headers, short Content-Lengths and
byte noise against a real tiny-model `serve` and a gate in front of it, and requests
whose sampling fields sit at and far beyond their bounds (`--engine-only`: those
alone). After every case a plain request goes straight to serve: a case after which
the engine serves none stopped it. Afterwards: both servers answer /health, the engine
is idle and its block pool passes check_integrity() with no block held.

    .venv/bin/python bench/fuzz_http.py --cases 5000
    .venv/bin/python bench/fuzz_http.py --cases 300 --engine-only
Prints one JSON document: cases, answers by status, problems (malformed answers, 5xx,
a stopped engine), 5xx answers to cases other than valid requests, dead engines (and
the case that stopped it), log records with a traceback or at ERROR, and the
after-checks. The run is `"valid"` when the cases asked for were sent and answered,
the requests known to stop an engine without its checks were among them, and the engine was checked
after every case (a harness that sent nothing, or did not look, found nothing); the
goal, judged on a valid run: no problem, no 5xx, no dead engine, no traceback, both
servers alive, the engine idle and its pool intact.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity  # noqa: E402


def judge(out: dict, asked: int, killers: int) -> dict:
    v = Validity()
    answered = sum(out["statuses"].values())
    v.require(out["cases"] >= asked + killers, f"{out['cases']} cases sent of {asked} asked and {killers} known killers")
    v.require(answered > 0, "no answer at all: the servers were not exercised")
    v.require(out["plain_checks"] >= out["cases"], f"the engine was checked after {out['plain_checks']} of "
              f"{out['cases']} cases: a case that stopped it could pass unseen")
    ok = (out["problems"] == 0 and out["5xx"] == 0 and out["dead_engines"] == 0
          and out["tracebacks_or_errors_in_logs"] == 0
          and out["servers_alive_after"] and out["engine_idle_after"] and out["block_pool_integrity"] == "ok")
    return {**v.as_dict(), "goal_no_problem": v.goal(ok)}


def main(args: argparse.Namespace) -> dict:
    from hypothesis import HealthCheck, example, given, seed, settings

    from tests.serve.fuzz_harness import KILLERS, Fuzz, engine_cases, http_case, run_case

    fuzz = Fuzz().start()
    problems: list[str] = []
    t0 = time.monotonic()
    try:
        @seed(args.seed)
        @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  phases=[p for p in __import__("hypothesis").Phase if p.name in ("explicit", "generate")])
        @given(case=engine_cases() if args.engine_only else http_case())
        def one(case):
            problem = run_case(fuzz, case)
            if problem:
                problems.append(f"{case[0]}: {problem} <- {case[1][:200]!r}")

        for case in KILLERS:
            one = example(case=case)(one)
        one()
        elapsed, cases = time.monotonic() - t0, fuzz.cases  # before the after-checks' own requests
        alive, idle = fuzz.alive(), fuzz.wait_idle()
        try:
            fuzz.check_integrity()
            integrity = "ok"
        except Exception as exc:  # reported, not raised: this is a measurement
            integrity = f"FAILED: {exc}"
    finally:
        fuzz.stop()
    out = {"cases": cases, "seed": args.seed, "seconds": round(elapsed, 1),
            "statuses": {str(k): v for k, v in sorted(fuzz.statuses.items(), key=lambda kv: str(kv[0]))},
            "5xx": sum(v for k, v in fuzz.statuses.items() if isinstance(k, int) and k >= 500),
            "problems": len(problems), "problem_examples": problems[:5],
            "5xx_from_bad_input": fuzz.bad_input_5xx, "plain_checks": fuzz.plain_checks,
            "dead_engines": int(fuzz.killer is not None),
            "engine_stopped_after": None if fuzz.killer is None else fuzz.killer[:300].decode(errors="replace"),
            "tracebacks_or_errors_in_logs": len(fuzz.bad_logs.records), "log_examples": fuzz.bad_logs.records[:5],
            "servers_alive_after": alive, "engine_idle_after": idle, "block_pool_integrity": integrity}
    return {**out, **judge(out, args.cases, len(KILLERS))}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--engine-only", action="store_true", help="only requests with sampling fields at their extremes")
    print(json.dumps(main(p.parse_args()), indent=2))
