"""Bad input at the gate's edge: a JSON error naming the problem, never a 500 with a
traceback. Deeply nested JSON, chat messages that are not message objects (with a local
tokenizer and without), an upstream /tokenize that answers something else, and an API
key file others can read."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from aiohttp import web

from tests.gate.job_env import HeldUpstream, gate_in_process
from tierguard.cli.main import main


def _nest(depth: int, leaf: str) -> str:
    return "[" * depth + leaf + "]" * depth


async def _raw(s, url: str, raw: str) -> tuple[int, dict]:
    async with s.post(url, data=raw, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


def _tokenizer_dir() -> str:
    from tierguard.model.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.mark.parametrize("tokenizer", [False, True], ids=["estimate", "local_tokenizer"])
def test_deeply_nested_json_is_a_400_naming_it(tmp_path, caplog, tokenizer):
    caplog.set_level(logging.INFO)
    deep = 100_000

    async def go():
        up = await HeldUpstream().start()
        up.release()
        try:
            async with gate_in_process(up.url, tmp_path / "jobs", tokenizer=_tokenizer_dir() if tokenizer else None,
                                       tokenizer_workers=1) as (_app, gate, s):
                return [await _raw(s, gate + route, raw) for route, raw in (
                    ("/v1/completions", _nest(deep, "1")),
                    ("/v1/completions", '{"prompt": ' + _nest(deep, '"x"') + '}'),
                    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": ' + _nest(deep, "{}") + '}]}'),
                    ("/v1/async/completions", '{"prompt": "x", "extra": ' + _nest(deep, "1") + '}'),
                    ("/tokenize", '{"prompt": ' + _nest(deep, '"x"') + '}'),
                )]
        finally:
            await up.stop()

    for status, body in asyncio.run(go()):
        assert status == 400 and "nested too deeply" in body["error"]["message"], body
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_deep_body_the_parser_takes_is_still_stored_as_a_job(tmp_path):
    """Nesting the parser accepts (below Python's recursion limit) is walked without
    recursion when the job file is written: a 202, not a 500."""
    async def go():
        up = await HeldUpstream().start()
        up.release()
        try:
            async with gate_in_process(up.url, tmp_path / "jobs") as (_app, gate, s):
                return await _raw(s, gate + "/v1/async/completions", '{"prompt": "x", "extra": ' + _nest(700, "1") + '}')
        finally:
            await up.stop()

    status, body = asyncio.run(go())
    assert status == 202, body


@pytest.mark.parametrize("tokenizer", [False, True], ids=["estimate", "local_tokenizer"])
def test_messages_that_are_not_message_objects_are_a_400(tmp_path, caplog, tokenizer):
    caplog.set_level(logging.INFO)
    cases = [
        ([1, 2], "messages[0] must be an object with 'role' and 'content', got a number"),
        ([{"role": "user", "content": "hi"}, "x"], "messages[1] must be an object"),
        ([{"content": "hi"}], "messages[0].role must be a string"),
        ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list of parts"),
        ([{"role": "user", "content": ["a"]}], "messages[0].content[0] must be an object"),
        ([], "'messages' must be a non-empty list"),
    ]

    async def go():
        up = await HeldUpstream().start()
        up.release()
        try:
            async with gate_in_process(up.url, tmp_path / "jobs", tokenizer=_tokenizer_dir() if tokenizer else None,
                                       tokenizer_workers=1, exact_token_count=True) as (_app, gate, s):
                out = []
                for messages, _ in cases:
                    async with s.post(gate + "/v1/chat/completions", json={"model": "m", "messages": messages}) as r:
                        out.append((r.status, await r.json(content_type=None)))
                return out
        finally:
            await up.stop()

    for (status, body), (_, words) in zip(asyncio.run(go()), cases, strict=True):
        assert status == 400 and words in body["error"]["message"], body
    assert "Traceback" not in caplog.text


def test_an_upstream_tokenize_that_answers_a_list_is_not_a_500(tmp_path):
    """The probe at start gets a proper answer; later calls get a JSON array: the gate counts
    another way (the estimate) instead of failing the request."""
    calls = []

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(body)
        return web.json_response({"count": 3} if "prompt" in body and len(calls) == 1 else [1, 2, 3])

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def go():
        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/v1/chat/completions", complete)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with gate_in_process(url, tmp_path / "jobs", exact_token_count=True) as (_app, gate, s):
                async with s.post(gate + "/v1/chat/completions",
                                  json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}) as r:
                    return r.status
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == 200
    assert "messages" in calls[1]  # the probe, then the chat count that got the array


def test_an_api_key_file_others_can_read_is_refused_like_the_encryption_key(tmp_path, capsys):
    from tierguard.common.errors import TierguardError
    from tierguard.gate.policy import _read_keys, build_settings

    keys = tmp_path / "keys"
    keys.write_text("sk-one\nsk-two\n")
    os.chmod(keys, 0o644)
    options = {"upstream": "http://127.0.0.1:9", "jobs_dir": str(tmp_path / "jobs"), "api_key_file": str(keys)}
    with pytest.raises(TierguardError) as refused:  # settings first: a gate that took it would start serving
        build_settings(options)
    msg = str(refused.value)
    assert "API key file" in msg and "group or others" in msg and "chmod 600" in msg and "sk-one" not in msg
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # never waited on
    argv = ["gate", "--upstream", "http://127.0.0.1:9", "--port", "0", "--jobs-dir", str(tmp_path / "jobs")]
    assert main([*argv, "--api-key-file", str(fifo)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a regular file" in err
    os.chmod(keys, 0o600)
    assert _read_keys(str(keys)) == ["sk-one", "sk-two"]


def test_urls_in_gate_errors_never_show_a_password(capsys):
    secret = "s3cret-Pa55word"
    for flags, words in ((["--shared-state", f"memcached://:{secret}@h:1"], "--shared-state must be a redis://"),
                         (["--upstream", f"ftp://u:{secret}@h:1"], "--upstream must be an http(s) URL")):
        argv = ["gate", "--upstream", "http://127.0.0.1:9", *flags]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and secret not in err and "***" in err, err
