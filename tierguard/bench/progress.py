"""Live progress with running p99s, and the final table (rich, on stderr).

`LiveStats` is fed finished requests (in-process, or in batches from worker processes)
and keeps bounded windows, so rendering stays cheap however long the run is.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tierguard.bench.records import RequestRecord
from tierguard.common.percentile import percentile


def _p99(d: deque) -> str:
    return f"{percentile(d, 99):.1f}" if d else "-"


def brief(rec: RequestRecord) -> tuple:
    """The little a progress display needs from a finished request (cheap to pickle)."""
    gaps = rec.chunk_gaps_ms()
    k = np.maximum(np.asarray(rec.chunk_tokens[1:], dtype=float), 1.0) if gaps.size else gaps
    return rec.ok, rec.ttft_ms, (gaps / k).tolist() if gaps.size else []


class LiveStats:
    def __init__(self, total: int | None, enabled: bool) -> None:
        self.ok = self.failed = 0
        self.ttft: deque[float] = deque(maxlen=2000)
        self.itl: deque[float] = deque(maxlen=50000)
        self.console = Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"), console=self.console, auto_refresh=False, transient=False,
        )
        self.task = self.progress.add_task("bench", total=total, stats="")
        if self.enabled:
            self.progress.start()

    def add(self, item: tuple) -> None:
        ok, ttft, itl = item
        if ok:
            self.ok += 1
            if ttft is not None:
                self.ttft.append(ttft)
            self.itl.extend(itl)
        else:
            self.failed += 1

    def refresh(self, note: str = "") -> None:
        if not self.enabled:
            return
        stats = f"p99 TTFT {_p99(self.ttft)} ms  p99 ITL {_p99(self.itl)} ms  failed {self.failed} {note}"
        self.progress.update(self.task, completed=self.ok + self.failed, stats=stats)
        self.progress.refresh()

    def close(self) -> None:
        if self.enabled:
            self.refresh()
            self.progress.stop()


def final_table(summary: dict) -> Table:
    t = Table(title="tierguard bench (ms; from scheduled send time)")
    cols = ["mean", "median", "p90", "p99", "p999", "max"]
    t.add_column("metric")
    for c in cols:
        t.add_column(c, justify="right")
    for name, label in [("ttft_ms", "TTFT (prefill)"), ("tpot_ms", "TPOT (decode)"), ("itl_ms", "ITL per token"),
                        ("chunk_gap_ms", "inter-chunk gap"), ("stall_ms", "stall / request"),
                        ("e2el_ms", "E2E latency"), ("queue_wait_ms", "client queue wait"),
                        ("connect_ms", "connection set-up")]:
        vals = [summary.get(f"{c}_{name}") for c in cols]
        t.add_row(label, *["-" if v is None else f"{v:.1f}" for v in vals])
    return t


def print_final(summary: dict, out_dir: str | None) -> None:
    console = Console(stderr=True)
    console.print(final_table(summary))
    line = (f"completed {summary['completed']}  failed {summary['failed']} (rejected {summary['rejected']}, "
            f"timeouts {summary['timeouts']})  {summary['request_throughput']:.2f} req/s  "
            f"{summary['output_throughput']:.1f} tok/s")
    if summary.get("goodput") is not None:
        line += f"  goodput {summary['goodput']:.2f} req/s ({summary['slo_attainment']:.0%} within SLO)"
    console.print(line, highlight=False)
    if summary.get("client_distorted"):
        console.print("[bold red]CLIENT DISTORTED:[/] " + "; ".join(summary.get("distortion_reasons", [])))
    q = summary.get("quirks") or {}
    notes = []
    if q.get("dropped_fields"):
        notes.append(f"rejected fields, sent without: {', '.join(q['dropped_fields'])}")
    if q.get("sends_done") is False:
        notes.append("no [DONE]")
    if q.get("sends_usage") is False:
        notes.append(f"no usage in stream (tokens counted by {summary.get('token_count_source') or '?'})")
    if notes:
        console.print("server quirks: " + "; ".join(notes), highlight=False)
    if summary.get("prompt_lengths") == "approximate":
        console.print("prompt lengths are approximate (no --tokenizer and no /tokenize on the server)")
    if out_dir:
        console.print(f"results in {out_dir}")
