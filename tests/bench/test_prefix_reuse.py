"""A run that claims unique prompts is checked against the server's own prefix-cache
counters (tierguard/bench/prefix_reuse.py), against a real `tierguard serve`.

Levels drawn from one UniqueBodies on one server find nothing in the prefix cache beyond
the prefix every prompt shares; a level that replays an earlier level's prompts is
marked invalid by the counters, not by trusting the client.
"""

from __future__ import annotations

import json
import sys
import urllib.request

import numpy as np
import pytest

from tierguard.bench import prefix_reuse
from tierguard.bench.prefix_reuse import UniqueBodies
from tierguard.cli.serve import READY_PREFIX
from tierguard.common.proc import ReadyProcess

SHARED = 32  # two whole blocks of 16 in front of every prompt, as a chat template's tokens
PROMPT = 96


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    cmd = [sys.executable, "-m", "tierguard", "serve", "--model", "tiny", "--port", "0",
           "--max-model-len", "256", "--kv-cache-gib", "0.05"]
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with ReadyProcess(cmd, READY_PREFIX, stderr_path=log) as child:
        yield child.start(timeout_s=300).split()[0]


def send(url: str, prompt: list[int]) -> None:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def level(url: str, bodies: UniqueBodies | list, n: int) -> dict:
    before = prefix_reuse.read_counters(url)
    sent = 0
    for i in range(n):
        b = bodies.take() if isinstance(bodies, UniqueBodies) else bodies[i % len(bodies)]
        if b is None:
            break
        send(url, b)
        sent += 1
    return prefix_reuse.judge(before, prefix_reuse.read_counters(url), sent, SHARED)


def test_levels_on_one_server_find_only_the_shared_prefix_and_a_replay_is_invalid(url):
    rng = np.random.default_rng(5)
    head = [int(t) for t in rng.integers(10, 4000, size=SHARED)]
    prompts = [head + [int(t) for t in rng.integers(10, 4000, size=PROMPT - SHARED)] for _ in range(24)]
    assert prefix_reuse.shared_prefix_tokens(prompts) >= SHARED
    pool = UniqueBodies(prompts)
    first, second = level(url, pool, 12), level(url, pool, 12)
    for lv in (first, second):
        assert lv["reason"] is None, lv
        assert lv["prefix_cache_query_tokens"] >= 12 * PROMPT - 12  # the counters moved: the check looked
        assert lv["prefix_cache_hit_tokens"] <= 12 * SHARED
    assert second["prefix_cache_hit_tokens"] == 12 * SHARED  # the shared head, found every time
    assert pool.take() is None  # both levels together used every prompt once

    replay = level(url, prompts[:12], 12)  # the first level's prompts again
    assert replay["prefix_cache_hit_tokens"] > 12 * SHARED
    assert replay["reason"] and "prompts were reused" in replay["reason"]


def test_a_server_without_counters_is_named_not_passed():
    assert prefix_reuse.read_counters("http://127.0.0.1:9") is None
    out = prefix_reuse.judge(None, None, 10, SHARED)
    assert out["reason"] is None and out["prefix_cache_hit_tokens"] is None and "not checked" in out["note"]
    assert prefix_reuse.shared_prefix_tokens([[1, 2, 3], [1, 2, 4], [1, 5]]) == 1
    assert prefix_reuse.shared_prefix_tokens([[1, 2]]) == 0
