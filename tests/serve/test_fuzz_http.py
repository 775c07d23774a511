"""Property-based fuzzing of serve's and the gate's routes.

Generated JSON bodies (near-valid requests, arbitrary JSON, raw bytes), odd headers,
wrong Content-Lengths and byte noise go to completions, chat, tokenize/detokenize and
the async job routes of a real tiny-model server and of a gate in front of it. Every
answer must be well formed (JSON with the OpenAI error shape, or an SSE stream ending
in [DONE]), never a 5xx; no log record carries a traceback or ERROR level; both servers
still answer /health; and once idle, the engine's block pool passes check_integrity()
with no block held. Seeded, so a failure reproduces.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, seed, settings

from tests.serve.fuzz_harness import Fuzz, check, http_case


@pytest.fixture(scope="module")
def fuzz():
    f = Fuzz().start()
    yield f
    f.stop()


def _run(fuzz: Fuzz, n: int, seed_value: int) -> None:
    failures: list[str] = []

    @seed(seed_value)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=http_case())
    def one(case):
        target, raw, framing_ok, half_close = case
        problem = check(fuzz.send(target, raw, half_close=half_close), framing_ok)
        if problem:
            failures.append(f"{target}: {problem}\n  request: {raw[:300]!r}")
        assert not problem, failures[-1]

    one()
    assert fuzz.alive(), "a server stopped answering /health"
    assert fuzz.wait_idle(), "requests still running long after the fuzz ended"
    fuzz.check_integrity()
    assert not fuzz.bad_logs.records, fuzz.bad_logs.records[:5]
    print(json.dumps({"fuzz_cases": fuzz.cases, "statuses": {str(k): v for k, v in fuzz.statuses.items()},
                      "5xx": sum(v for k, v in fuzz.statuses.items() if isinstance(k, int) and k >= 500),
                      "tracebacks": len(fuzz.bad_logs.records)}))


def test_fuzz_routes_200_cases(fuzz):
    _run(fuzz, 200, 15)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_routes_5000_cases(fuzz):
    _run(fuzz, 5000, 1515)
