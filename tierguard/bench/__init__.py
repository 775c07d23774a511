"""`tierguard bench`: open-loop load generation with honest per-token timing.

Python API (used by `tierguard sweep` and scripts)::

    from tierguard.bench import BenchConfig, run_bench, load_run
    result = run_bench(BenchConfig(base_url="http://127.0.0.1:8000", max_concurrency=8))
    result.summary["p99_ttft_ms"]; load_run("out/").records

`run_bench` is synchronous (it runs its own event loop); call it from a thread, not
from inside a running asyncio loop. Names are imported lazily so that starting the
schedule server (`python -m tierguard.bench.schedule_server`) stays cheap.

Layout: config (inputs) · strategy (when requests are due) · datasets/prompts (what
is sent) · backend/rawhttp/sse (HTTP and chunk timing) · worker/multiproc (dispatch) ·
records/stats (definitions and statistics) · selfcheck/scrape (is the client or server
distorting) · results/envinfo/topo (what is written) · runner (the whole run).
"""

from __future__ import annotations

_EXPORTS = {
    "BenchConfig": "tierguard.bench.config",
    "SLO": "tierguard.bench.config",
    "parse_slo": "tierguard.bench.config",
    "run_bench": "tierguard.bench.runner",
    "BenchResult": "tierguard.bench.runner",
    "load_run": "tierguard.bench.results",
    "LoadedRun": "tierguard.bench.results",
    "RequestRecord": "tierguard.bench.records",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
