"""`--workers N`: N client processes sharing one schedule.

Why: one Python process stamps chunks late once it drives hundreds of streams. Each
worker gets every N-th request of the same seeded schedule and the same t0 (CLOCK_MONOTONIC
is system-wide, so offsets agree across processes). The parent only starts them, shows
progress, scrapes `/metrics` and merges the records each worker pickles to a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from tierguard.bench.config import BenchConfig
from tierguard.bench.progress import LiveStats, brief
from tierguard.bench.scrape import MetricsScraper
from tierguard.bench.worker import WorkerOutput, WorkerPlan, run_async, run_worker
from tierguard.common.errors import TierguardError


def _child(plan: WorkerPlan, t0_value, go, stop, q, result_path: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        batch: list = []
        last = [time.monotonic()]

        def on_done(rec) -> None:
            batch.append(brief(rec))
            if time.monotonic() - last[0] > 0.5:
                q.put(("progress", list(batch)))
                batch.clear()
                last[0] = time.monotonic()

        def start_at() -> float:
            q.put(("ready", plan.worker))
            go.wait()
            return t0_value.value

        out = run_async(run_worker(plan, start_at, stop.is_set, on_done))
        q.put(("progress", batch))
        Path(result_path).write_bytes(pickle.dumps(out))
    except BaseException:  # reported to the parent, which writes partial results
        Path(result_path + ".err").write_text(traceback.format_exc())


@contextlib.asynccontextmanager
async def scraping_until_sigint(cfg: BenchConfig, on_sigint: Callable[[], None]) -> AsyncIterator[MetricsScraper]:
    """While the run lasts: Ctrl-C calls `on_sigint` (a graceful stop, not a traceback) and
    the server's /metrics is scraped; both are undone however the body ends."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    scraper = MetricsScraper(cfg.base_url, cfg.auth_headers, cfg.scrape_interval_s)
    scraper.start()
    try:
        yield scraper
    finally:
        await scraper.stop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)


async def _supervise(cfg: BenchConfig, procs, q, stop, live: LiveStats) -> tuple[MetricsScraper, bool]:
    interrupted = asyncio.Event()
    async with scraping_until_sigint(cfg, interrupted.set) as scraper:
        while any(p.is_alive() for p in procs):
            if interrupted.is_set():
                stop.set()
            _drain(q, live)
            live.refresh()
            await asyncio.sleep(0.25)
        _drain(q, live)
    return scraper, interrupted.is_set()


def _drain(q, live: LiveStats) -> None:
    while True:
        try:
            kind, payload = q.get_nowait()
        except queue.Empty:
            return
        if kind == "progress":
            for item in payload:
                live.add(item)


def run_workers(cfg: BenchConfig, plans: list[WorkerPlan], live: LiveStats) -> tuple[list[WorkerOutput], MetricsScraper, bool]:
    ctx = mp.get_context("spawn")
    go, stop, q = ctx.Event(), ctx.Event(), ctx.Queue()
    t0_value = ctx.Value("d", 0.0)
    with tempfile.TemporaryDirectory(prefix="tierguard-bench-") as tmp:
        paths = [str(Path(tmp) / f"worker-{p.worker}.pkl") for p in plans]
        procs = [ctx.Process(target=_child, args=(p, t0_value, go, stop, q, path), daemon=True)
                 for p, path in zip(plans, paths, strict=True)]
        for p in procs:
            p.start()
        try:
            ready, deadline = 0, time.monotonic() + 120
            while ready < len(procs):
                if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                    raise TierguardError("bench worker processes did not start")
                try:
                    kind, _ = q.get(timeout=0.5)
                    ready += kind == "ready"
                except queue.Empty:
                    pass
            t0 = time.monotonic() + 0.1
            t0_value.value = t0
            go.set()
            scraper, interrupted = run_async(_supervise(cfg, procs, q, stop, live))
        finally:
            stop.set()
            go.set()
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        outputs, errors = [], []
        for path in paths:
            if Path(path).is_file():
                outputs.append(pickle.loads(Path(path).read_bytes()))
            elif Path(path + ".err").is_file():
                errors.append(Path(path + ".err").read_text().strip().splitlines()[-1])
        if errors and not outputs:
            raise TierguardError(f"{len(errors)} bench worker(s) failed: {errors[0]}")
        for e in errors:  # the others' records still count; the summary says what was lost
            outputs.append(WorkerOutput(records=[], health=None, quirks=None, worker_error=e))
    return outputs, scraper, interrupted
