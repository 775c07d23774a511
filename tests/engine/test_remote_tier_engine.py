"""The remote tier behind the engine, configured by name only (`kv_media={"remote": ...}`):
a prefix written behind by one engine is staged from Redis by another, after host RAM
and the local disk; Redis killed or down turns every staged load into a counted
recompute with the same greedy outputs, never an error. `GuardSpy` watches the engine
while it stages from Redis: every Redis round trip and every remote read stays off the
engine thread and outside the decode guard."""

from __future__ import annotations

import os
import signal

import pytest

from tests.engine.conftest import make_engine
from tests.engine.guard_spy import GuardSpy
from tests.engine.test_tiers import PROMPTS, run
from tests.kv.conftest import wait_until
from tierguard.common.redis_server import free_port
from tierguard.engine.api import SamplingParams
from tierguard.engine.prefix_hash import prefix_block_hashes

SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)  # the prefill is what matters here


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return run(make_engine(tiny_dir), PROMPTS[:3], SHORT)


def remote(url: str) -> dict:
    return {"remote": {"url": url, "refresh_s": 0.02, "timeout_ms": 50}}


def flat(engine) -> dict[str, float]:
    return engine.stats().flat()


def spy_on(engine) -> GuardSpy:
    """The engine's step points and remote reads, plus every Redis call of its remote medium
    (a command or a pipeline): none of them may run on the engine thread."""
    client = engine.connector.media["remote"].client
    return GuardSpy(engine, off_engine=(("remote.redis_command", client, "execute_command"),
                                        ("remote.redis_pipeline", client, "pipeline")))


def test_a_prefix_written_by_one_engine_is_loaded_by_another(tiny_dir, reference, redis_server):
    b = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=remote(redis_server.url))  # running already
    a = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=remote(redis_server.url))
    try:
        assert run(a, PROMPTS[:3], SHORT) == reference
        a.close()  # the write-behind ends here
        written = flat(a)["kv_remote_writes"]
        assert written > 0 and flat(a)["kv_persisted_blocks"] == written
        medium = b.connector.media["remote"]
        wait_until(lambda: len(medium.index) == written)  # learned from the journal, not asked
        spy = spy_on(b)
        assert run(b, PROMPTS[:3], SHORT) == reference
        spy.assert_contract(read_media=("remote",))
        x = flat(b)
        assert x["kv_remote_hits"] > 0 and x["kv_blocks_loaded_from_remote"] == x["kv_remote_hits"]
        assert x["kv_transfer_remote_to_host_jobs"] > 0 and x["kv_remote_read_bytes"] > 0
        assert x["kv_remote_misses"] == 0 and x["kv_remote_errors"] == 0
        assert "remote_to_host" in b.stats().tiers.latency  # the per-route load histogram
        # a block loaded from remote is kept in host RAM
        prompt_blocks = [prefix_block_hashes(p, 4, b.block_manager.fingerprint) for p in PROMPTS[:3]]
        remote_blocks = [h for hs in prompt_blocks for h in hs if medium.contains(h)]
        assert len(remote_blocks) >= x["kv_remote_hits"]
        assert all(b.connector.host.contains(h) for h in remote_blocks)
    finally:
        b.close()


def test_disk_is_looked_up_before_remote(tiny_dir, reference, redis_server, tmp_path):
    opts = dict(
        kv_host_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.05, kv_media=remote(redis_server.url)
    )
    first = make_engine(tiny_dir, **opts)
    assert run(first, PROMPTS[:2], SHORT) == reference[:2]
    first.close()
    assert list(first.connector.media) == ["disk", "remote"]
    x = flat(first)
    assert x["kv_disk_writes"] == x["kv_remote_writes"] > 0  # both media got the prefix
    second = make_engine(tiny_dir, **opts)  # empty host RAM; disk and Redis both hold it
    try:
        assert run(second, PROMPTS[:2], SHORT) == reference[:2]
        x = flat(second)
        assert x["kv_disk_hits"] > 0 and x["kv_remote_hits"] == 0 and x["kv_remote_read_bytes"] == 0
    finally:
        second.close()


@pytest.mark.parametrize("request_class", ["interactive", "batch"])
def test_redis_killed_mid_run_recomputes_and_counts(tiny_dir, reference, redis_server, request_class):
    """Redis SIGKILLed while requests run: the first was staged from Redis and is still
    decoding, the second's load is in flight or done, the third arrives after the kill.
    Every answer is the reference, every load that failed is a counted recompute, and the
    cold contract held throughout."""
    writer = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=remote(redis_server.url))
    run(writer, PROMPTS[:3], SHORT)
    writer.close()
    engine = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=remote(redis_server.url))
    try:
        assert len(engine.connector.media["remote"].index) > 0
        spy = spy_on(engine)
        ids = [f"{request_class}-{i}" for i in range(3)]
        out: dict[str, list[int]] = {rid: [] for rid in ids}

        def step() -> None:
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
            engine.check_integrity()

        engine.add_request(ids[0], PROMPTS[0], SHORT, request_class=request_class)
        while not out[ids[0]]:  # staged from Redis, prefilled the rest, first token out
            step()
        hits = flat(engine)["kv_remote_hits"]
        assert hits > 0
        engine.add_request(ids[1], PROMPTS[1], SHORT, request_class=request_class)
        step()
        redis_server.kill()  # SIGKILL, with the first request decoding
        assert engine.has_unfinished() and len(out[ids[0]]) < SHORT.max_tokens
        engine.add_request(ids[2], PROMPTS[2], SHORT, request_class=request_class)
        while engine.has_unfinished():
            step()
        assert [out[r] for r in ids] == reference  # recomputed where Redis failed: same tokens
        x = flat(engine)
        failed = x[f"kv_staging_failures_{request_class}"]
        assert x[f"kv_contract_{request_class}_recompute"] == failed and 1 <= failed <= 2  # the third, maybe the second
        assert x["kv_remote_errors"] > 0 and x["kv_remote_healthy"] == 0
        health = engine.connector.health()["remote"]
        assert health[0] is False and "redis unreachable" in health[1]
        spy.assert_contract(read_media=("remote",))
    finally:
        engine.close()


def test_redis_down_at_start_serves_and_reports(tiny_dir, reference):
    url = f"redis://127.0.0.1:{free_port()}/0"
    engine = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=remote(url))
    try:
        assert engine.connector.health()["remote"][0] is False
        assert run(engine, PROMPTS[:3], SHORT) == reference
        x = flat(engine)
        assert x["kv_remote_writes"] == 0 and x["kv_remote_healthy"] == 0
    finally:
        engine.close()


def test_a_hung_redis_meets_the_class_deadline(tiny_dir, reference, redis_server):
    """Redis stopped (SIGSTOP) with reads slower than the staging deadline: interactive
    recomputes at its deadline; batch keeps waiting, then recomputes when the read fails."""
    writer = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=remote(redis_server.url))
    run(writer, PROMPTS[:2], SHORT)
    writer.close()
    media = {"remote": {"url": redis_server.url, "refresh_s": 60, "timeout_ms": 400}}
    engine = make_engine(
        tiny_dir, kv_host_gib=0.01, kv_media=media, ttft_budget_ms={"interactive": 100, "batch": 100}
    )
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        for cls, prompt, want in (
            ("interactive", PROMPTS[0], reference[0]),
            ("batch", PROMPTS[1], reference[1]),
        ):
            engine.add_request(cls, prompt, SHORT, request_class=cls)
            got: list[int] = []
            while engine.has_unfinished():
                for o in engine.step():
                    got.extend(o.new_token_ids)
            assert got == want, cls
        x = flat(engine)
        assert (
            x["kv_staging_deadline_misses_interactive"] == 1 and x["kv_contract_interactive_recompute"] == 1
        )
        assert x["kv_tier_recomputes"] == 1  # the interactive load, abandoned at its deadline
        assert x["kv_contract_batch_wait"] == 1 and x["kv_contract_batch_recompute"] == 1
        assert x["kv_staging_failures_batch"] == 1 and x["kv_remote_hits"] == 0
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        engine.close()
