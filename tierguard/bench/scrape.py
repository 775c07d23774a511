"""Server-side signals: scrape `/metrics` (Prometheus text) during the run.

R13: a tier is judged by device latency, queue depth and hit rate, which only the server
knows. Every sample except histogram buckets is kept per scrape (`metrics.jsonl`), and
the summary lists the range of the series that look like KV usage, queue depth, cache
hits, tiers or preemptions. A server without `/metrics` is noted once and left alone.
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

INTERESTING = re.compile(r"usage|waiting|running|queue|hit|tier|preempt|swap|offload|kv", re.I)


def parse_metrics(text: str) -> dict[str, float]:
    """Flatten Prometheus text into {'name{label="v"}': value}, without `_bucket` samples."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


class MetricsScraper:
    def __init__(self, base_url: str, headers: dict[str, str], interval_s: float) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.headers, self.interval = headers, interval_s
        self.series: list[dict] = []  # {"t": CLOCK_MONOTONIC seconds, "samples": {...}}
        self.status = "not started"
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.interval * 2))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    async with session.get(self.url, headers=self.headers) as resp:
                        if resp.status == 404:
                            self.status = "server has no /metrics"
                            return
                        text = await resp.text()
                    self.series.append({"t": time.monotonic(), "samples": parse_metrics(text)})
                    self.status = "ok"
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                    self.status = f"scrape failed: {type(exc).__name__}"
                await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # a failed scrape must not fail the run
                pass

    def relative_to(self, t0: float) -> list[dict]:
        return [{"t": round(row["t"] - t0, 3), "samples": row["samples"]} for row in self.series]

    def highlights(self) -> dict:
        """min/max/last of the interesting series."""
        keys: set[str] = set()
        for row in self.series:
            keys.update(k for k in row["samples"] if INTERESTING.search(k))
        out = {}
        for k in sorted(keys):
            vals = [row["samples"][k] for row in self.series if k in row["samples"]]
            out[k] = {"min": min(vals), "max": max(vals), "last": vals[-1]}
        return {"status": self.status, "scrapes": len(self.series), "series": out}
