"""HTTP-layer behaviour against a model-free engine: validation, framing, auth, abort.

These run in milliseconds; the same behaviours against the real engine and tiny model
are in test_real_engine.py.
"""

from __future__ import annotations

import asyncio

import pytest

from tierguard.serve.app import create_app

from .fake_engine import FakeEngine
from .helpers import parse_sse, serve, wait_for


def run(coro):
    return asyncio.run(coro)


async def _post(client, path, body=None, *, data=None, headers=None):
    resp = await client.post(path, json=body, data=data, headers=headers)
    return resp.status, await resp.json()


def test_engine_started_and_stopped_with_app():
    engine = FakeEngine()

    async def go():
        async with serve(create_app(engine)):
            assert engine.started
        assert not engine.started

    run(go())


@pytest.mark.parametrize(
    ("body", "data", "needle"),
    [
        (None, b"{not json", "not valid JSON"),
        ({"prompt": "hi", "max_tokens": "five"}, None, "max_tokens"),
        ({"prompt": 12}, None, "prompt"),
        ({"prompt": "hi", "temperature": -1}, None, "temperature"),
        ({"prompt": "hi", "n": 2}, None, "n=2"),
        ({"prompt": "hi", "logprobs": 3}, None, "logprobs"),
        ({"prompt": ["a", "b"]}, None, "batch of 2 prompts"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, None, "stream_options"),
    ],
)
def test_completions_rejects_bad_requests_with_openai_error(body, data, needle):
    async def go():
        async with serve(create_app(FakeEngine())) as client:
            return await _post(client, "/v1/completions", body, data=data)

    status, payload = run(go())
    assert status == 400
    err = payload["error"]
    assert needle in err["message"]
    assert err["type"] == "BadRequestError" and err["code"] == 400


def test_context_limit_names_both_numbers():
    async def go():
        async with serve(create_app(FakeEngine(max_model_len=64))) as client:
            return await _post(client, "/v1/completions", {"prompt": "x" * 40, "max_tokens": 30})

    status, payload = run(go())
    assert status == 400
    msg = payload["error"]["message"]
    assert "64" in msg and "40 in the prompt" in msg and "30 for the completion" in msg


def test_unknown_model_is_404_and_wrong_key_is_401():
    async def go():
        app = create_app(FakeEngine(), api_key="s3cret", served_model_name="tiny")
        async with serve(app) as client:
            ok = {"Authorization": "Bearer s3cret"}
            missing = await _post(client, "/v1/completions", {"prompt": "hi"})
            wrong = await _post(
                client, "/v1/completions", {"prompt": "hi"}, headers={"Authorization": "Bearer no"}
            )
            unknown = await _post(client, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, headers=ok)
            good = await _post(
                client, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3}, headers=ok
            )
            health = await client.get("/health")  # probes need no key
            return missing, wrong, unknown, good, health.status

    missing, wrong, unknown, good, health = run(go())
    assert missing[0] == 401 and wrong[0] == 401 and "API key" in wrong[1]["error"]["message"]
    assert unknown[0] == 404 and "gpt-9" in unknown[1]["error"]["message"]
    assert good[0] == 200 and good[1]["choices"][0]["text"] == "abc"
    assert good[1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert health == 200


def test_sampling_fields_reach_engine():
    engine = FakeEngine()

    async def go():
        async with serve(create_app(engine)) as client:
            body = {
                "messages": [{"role": "user", "content": "hi"}],
                "temperature": 0,
                "top_p": 0.5,
                "top_k": -1,
                "seed": 7,
                "stop": "zz",
                "stop_token_ids": [5],
                "ignore_eos": True,
                "max_completion_tokens": 4,
                "max_tokens": 9,
                "request_class": "batch",
            }
            bad_class = await _post(client, "/v1/chat/completions", {**body, "request_class": "Batch!"})
            assert bad_class[0] == 400 and "request_class" in bad_class[1]["error"]["message"]
            return await _post(client, "/v1/chat/completions", body)

    status, payload = run(go())
    assert status == 200, payload
    p = engine.seen_params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.0, 0.5, None, 7)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.max_tokens) == (["zz"], [5], True, 4)
    assert engine.seen_classes == ["batch"]
    assert payload["object"] == "chat.completion"
    assert payload["choices"][0]["message"] == {"role": "assistant", "content": "abcd"}


@pytest.mark.parametrize("chat", [False, True])
def test_stream_framing_with_usage_options(chat):
    async def go(options):
        async with serve(create_app(FakeEngine())) as client:
            body = {"max_tokens": 5, "stream": True, "stream_options": options}
            if chat:
                body["messages"] = [{"role": "user", "content": "hey"}]
            else:
                body["prompt"] = "hey"
            path = "/v1/chat/completions" if chat else "/v1/completions"
            resp = await client.post(path, json=body)
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            return parse_sse(await resp.text())

    events, done = run(go({"include_usage": True}))
    assert done
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    content = events[:-1]
    assert all("usage" not in e for e in content)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    if chat:
        assert content[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(e["choices"][0]["delta"]["content"] for e in content) == "abcde"
    else:
        assert "".join(e["choices"][0]["text"] for e in content) == "abcde"

    events, done = run(go({"include_usage": True, "continuous_usage_stats": True}))
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert done and counts == [1, 2, 3, 4, 5, 5]


def test_disconnect_mid_stream_aborts_and_frees_blocks():
    engine = FakeEngine(delay_s=0.01)

    async def go():
        async with serve(create_app(engine)) as client:
            resp = await client.post(
                "/v1/completions", json={"prompt": "hello", "max_tokens": 200, "stream": True}
            )
            await resp.content.readline()  # first event arrived: the request holds blocks
            assert engine.stats().kv_blocks_used > 0
            resp.close()  # drop the connection mid-stream
            freed = await wait_for(lambda: engine.stats().kv_blocks_used == 0)
            return freed, engine.stats()

    freed, stats = run(go())
    assert freed and stats.num_running == 0


def test_tokenize_detokenize_models_version_and_404_route():
    async def go():
        async with serve(create_app(FakeEngine(), served_model_name="tiny")) as client:
            tok = await _post(client, "/tokenize", {"prompt": "abc"})
            chat_tok = await _post(client, "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
            both = await _post(client, "/tokenize", {"prompt": "a", "messages": []})
            detok = await _post(client, "/detokenize", {"tokens": [104, 105]})
            bad_ids = await _post(client, "/detokenize", {"tokens": [100000]})
            models = await (await client.get("/v1/models")).json()
            version = await (await client.get("/version")).json()
            missing = await client.get("/v1/nothing")
            return tok, chat_tok, both, detok, bad_ids, models, version, missing.status, await missing.json()

    tok, chat_tok, both, detok, bad_ids, models, version, missing_status, missing = run(go())
    assert tok == (200, {"count": 3, "max_model_len": 256, "tokens": [97, 98, 99]})
    assert chat_tok[1]["count"] == len("<user>x<assistant>")
    assert both[0] == 400
    assert detok == (200, {"prompt": "hi"})
    assert bad_ids[0] == 400
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256
    assert version["version"]
    assert missing_status == 404 and "error" in missing


def test_metrics_exposes_vllm_names_and_step_stats():
    async def go():
        async with serve(create_app(FakeEngine(), served_model_name="tiny")) as client:
            await _post(client, "/v1/completions", {"prompt": "hey", "max_tokens": 4})
            return await (await client.get("/metrics")).text()

    text = run(go())
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "tierguard:step_duration_seconds_count",
        "tierguard:step_decode_seqs_bucket",
        "tierguard:engine_tier_ram_blocks",
    ):
        assert name in text, name
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
    assert lines['vllm:time_to_first_token_seconds_count{model_name="tiny"}'] == 1
    assert lines['vllm:inter_token_latency_seconds_count{model_name="tiny"}'] == 3
    assert lines['vllm:generation_tokens_total{model_name="tiny"}'] == 4
    assert lines['tierguard:step_duration_seconds_count{model_name="tiny"}'] == 4
    assert lines['vllm:request_success_total{finished_reason="length",model_name="tiny"}'] == 1
