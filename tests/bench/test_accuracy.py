"""Ground truth: tierguard bench against the known-schedule server (a real subprocess).

The server logs every write (/truth: its time, how many tokens it carried, which requests
it stalled), so what the client reports is checked against the server's own record:
tokens per chunk, chunks per request, which requests stalled and where. How close the
client's clock readings come to the server's (milliseconds, under load) is a measurement,
not a unit test: `bench/client_accuracy.py` reports it.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from tierguard.bench.config import BenchConfig
from tierguard.bench.runner import run_bench
from tierguard.bench.schedule_server import ScheduleServer


def truth(base_url: str) -> dict[str, dict]:
    with urllib.request.urlopen(base_url + "/truth?reset=1", timeout=30) as r:
        return {row["id"]: row for row in json.loads(r.read())["requests"]}


def bench(server: ScheduleServer, **kw):
    truth(server.base_url)  # forget the preflight probe
    cfg = BenchConfig(base_url=server.base_url, input_len=8, show_progress=False, timeout=30, **kw)
    res = run_bench(cfg)
    return res, truth(server.base_url)


@pytest.fixture(scope="module")
def stall_server():
    with ScheduleServer(ttft_ms=40, itl_ms=10, stall_every=4, stall_ms=150, stall_at_token=5) as s:
        yield s


def test_percentiles_and_stalls_match_truth(stall_server):
    res, tr = bench(stall_server, output_len=24, num_requests=16, max_concurrency=4)
    s = res.summary
    assert s["completed"] == 16 and s["failed"] == 0
    pairs = [(r, tr[r.response_id]) for r in res.records]
    for r, t in pairs:  # every write the server made was read, as many tokens as it carried
        assert r.chunk_tokens == t["tokens"] and r.output_tokens == sum(t["tokens"]) == 24
        assert len(r.chunk_times_s) == len(t["times"])
    # The summary's percentiles are those of the records it summarises.
    ttft = np.array([r.ttft_ms for r, _ in pairs])
    itl = np.concatenate([r.itl_samples_ms() for r, _ in pairs])
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile(ttft, 99), abs=0.01)
    assert s["median_itl_ms"] == pytest.approx(np.median(itl), abs=0.01)
    # Every injected stall is found where the server put it: the server's record says which
    # requests it stalled (every 4th) and before which token; each of those has its longest
    # gap there (a 150 ms stall in 10 ms steps), and the run's longest stall is one of them.
    stalled = [(r, t) for r, t in pairs if t["stalled"]]
    assert len(stalled) == 4
    for r, t in stalled:
        true_gap = int(np.argmax(np.diff(t["times"])))
        assert int(np.argmax(np.diff(r.chunk_times_s))) == true_gap
        assert r.stall_ms > 0
    longest = max(pairs, key=lambda p: p[0].stall_ms)
    assert longest[1]["stalled"]
    # lower bounds only (a busy machine delays a read, it never makes a stall shorter)
    assert s["max_chunk_gap_ms"] >= 150 and max(r.stall_ms for r, _ in stalled) >= 100


@pytest.mark.parametrize("http_client", ["auto", "aiohttp"])
def test_four_tokens_per_chunk_read_as_four_tokens(http_client):
    with ScheduleServer(ttft_ms=20, itl_ms=15, tokens_per_chunk=4) as server:
        res, tr = bench(server, output_len=32, num_requests=6, max_concurrency=3, http_client=http_client)
    s = res.summary
    assert s["completed"] == 6
    for r in res.records:
        t = tr[r.response_id]  # what the server wrote: 8 writes of 4 tokens
        assert r.output_tokens == 32 == sum(t["tokens"])
        assert r.chunk_tokens == t["tokens"] == [4] * 8
        assert r.token_count_source == "usage_delta"
        # 32 tokens minus the 4 of the first chunk, each chunk's gap spread over its 4 tokens
        samples = r.itl_samples_ms()
        assert len(samples) == 28
        gaps = np.diff(np.asarray(r.chunk_times_s)) * 1000
        assert np.allclose(samples, np.repeat(gaps / 4, 4))
    # TTFT is when the first chunk (4 tokens) arrived: 20 + 3 x 15 ms at the earliest (a
    # loaded machine only delays it)
    assert s["median_ttft_ms"] >= 65
    assert s["total_output_tokens"] == 6 * 32


def test_tokenizer_counts_chunks_when_server_sends_no_usage(word_tokenizer):
    with ScheduleServer(ttft_ms=10, itl_ms=5, tokens_per_chunk=3, send_usage=False, send_done=False) as server:
        res, _ = bench(server, output_len=12, num_requests=3, tokenizer=word_tokenizer)
        assert res.summary["completed"] == 3
        for r in res.records:
            assert r.token_count_source == "tokenizer"
            assert r.chunk_tokens == [3, 3, 3, 3] and r.output_tokens == 12
        assert res.run_info["prompts"]["exact"] is True
        assert res.summary["quirks"]["sends_done"] is False
        # without a tokenizer the same stream can only be counted per chunk, and says so
        res2, _ = bench(server, output_len=12, num_requests=2)
        assert {r.token_count_source for r in res2.records} == {"chunk_count"}
