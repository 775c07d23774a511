"""Property-based fuzzing of serve's and the gate's routes.

Generated JSON bodies (near-valid requests, arbitrary JSON, raw bytes), odd headers,
wrong Content-Lengths and byte noise go to completions, chat, tokenize/detokenize and
the async job routes of a real tiny-model server and of a gate in front of it, and
requests whose sampling fields sit at and far beyond their bounds go to the engine.
Every answer must be well formed (JSON with the OpenAI error shape, or an SSE stream
ending in [DONE]), never a 5xx; after every case the engine still serves a plain
request; no log record carries a traceback or ERROR level; both servers still answer
/health; and once idle, the engine's block pool passes check_integrity() with no block
held. Seeded, so a failure reproduces; requests known to stop an engine without its
checks are sent first in every run.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, seed, settings

from tests.serve.fuzz_harness import KILLERS, Fuzz, engine_cases, http_case, run_case


@pytest.fixture(scope="module")
def fuzz():
    f = Fuzz().start()
    yield f
    f.stop()


def with_killers(test):
    for case in KILLERS:
        test = example(case=case)(test)
    return test


def _run(fuzz: Fuzz, n: int, seed_value: int, cases=None) -> None:
    failures: list[str] = []
    checked = fuzz.plain_checks

    @seed(seed_value)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=http_case() if cases is None else cases)
    @with_killers
    def one(case):
        problem = run_case(fuzz, case)
        if problem:
            killer = f"\n  the engine stopped after: {fuzz.killer[:300]!r}" if fuzz.killer else ""
            failures.append(f"{case[0]}: {problem}\n  request: {case[1][:300]!r}{killer}")
        assert not problem, failures[-1]

    one()
    assert fuzz.plain_checks - checked >= n + len(KILLERS), "the engine was not checked after every case"
    assert fuzz.alive(), "a server stopped answering /health"
    assert fuzz.wait_idle(), "requests still running long after the fuzz ended"
    fuzz.check_integrity()
    assert not fuzz.bad_logs.records, fuzz.bad_logs.records[:5]
    print(json.dumps({"fuzz_cases": fuzz.cases, "statuses": {str(k): v for k, v in fuzz.statuses.items()},
                      "5xx": sum(v for k, v in fuzz.statuses.items() if isinstance(k, int) and k >= 500),
                      "tracebacks": len(fuzz.bad_logs.records)}))


def test_fuzz_routes_200_cases(fuzz):
    _run(fuzz, 200, 15)


def test_fuzz_engine_parameters_30_cases(fuzz):
    """Sampling fields at their extremes only, each case followed by a plain request."""
    _run(fuzz, 30, 40, engine_cases())


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_routes_2000_cases(fuzz):
    """A longer run for `make test`; bench/fuzz_http.py runs any number (5000: docs/benchmarks.md)."""
    _run(fuzz, 2000, 1515)
