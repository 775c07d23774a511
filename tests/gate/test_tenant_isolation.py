"""Tenants behind one gate with `--cache-isolation per-key`: a key's prompt never hits
another key's cached prefix, and nothing a client receives says whether someone else sent
the same opening text.

Real parts: the gate as a subprocess, two `tierguard serve` replicas (in process, tiny
model, `cached_tokens` reporting on, so only the salt can keep the usage field away),
prefix routing. The cache checks read serve's own prefix-cache counters.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.gate.helpers import GateProcess
from tests.serve.helpers import serve
from tierguard.common.errors import TierguardError
from tierguard.gate.isolation import apply_salt, check_mode, key_salt
from tierguard.gate.prefix_index import PrefixIndex

SYSTEM = "manual: the pump has a valve and the valve has a seal. " * 12  # a few routing chunks, many blocks


def test_per_key_salts_are_stable_unguessable_and_cannot_be_escaped():
    a, b = key_salt("key-a"), key_salt("key-b")
    assert a == key_salt("key-a") and a != b and "key-a" not in a
    body = {"prompt": "x", "cache_salt": b}  # a client naming another key's salt...
    apply_salt(body, "per-key", "key-a")
    assert body["cache_salt"].startswith(a + ".") and body["cache_salt"] != b  # ...stays inside its own
    shared = {"prompt": "x", "cache_salt": "mine"}
    apply_salt(shared, "shared", "key-a")
    assert shared["cache_salt"] == "mine"  # shared: forwarded as it came
    with pytest.raises(TierguardError, match="cache_salt"):
        apply_salt({"cache_salt": 7}, "per-key", "key-a")
    with pytest.raises(TierguardError, match="needs API keys"):
        check_mode("per-key", has_keys=False)
    index = PrefixIndex(2, chunk_chars=16)
    text = "the same opening text, several chunks long"
    assert index.keys(text) == index.keys(text, None) and not set(index.keys(text, a)) & set(index.keys(text, b))


def test_two_keys_share_no_prefix_and_no_response_tells(tmp_path):
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model
    from tierguard.serve.app import create_app

    keys = tmp_path / "keys"
    keys.write_text("key-a\nkey-b\n")
    keys.chmod(0o600)
    log = tmp_path / "gate.jsonl"
    engines = [AsyncLLMEngine.from_model_dir(ensure_tiny_model(), model_name="tiny", max_model_len=1024,
                                             kv_cache_gib=0.02, dtype="float32", device="cpu") for _ in range(2)]

    def prefix_hits() -> int:
        return sum(e.engine.block_manager.prefix_hits for e in engines)

    async def main():
        async with serve(create_app(engines[0], prompt_tokens_details=True)) as r0, \
                serve(create_app(engines[1], prompt_tokens_details=True)) as r1:
            urls = [str(r.make_url("")).rstrip("/") for r in (r0, r1)]
            with GateProcess(urls[0], "--upstream", urls[1], "--route", "prefix", "--health-interval-s", "30",
                             "--api-key-file", str(keys), "--cache-isolation", "per-key",
                             jobs_dir=tmp_path / "jobs", log=log) as gate:
                async with aiohttp.ClientSession() as s:

                    async def ask(key: str) -> tuple[dict, dict]:
                        body = {"model": "tiny", "max_tokens": 2, "temperature": 0,
                                "messages": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": "why does it leak?"}]}
                        async with s.post(gate.url + "/v1/chat/completions", json=body,
                                          headers={"Authorization": f"Bearer {key}"}) as r:
                            assert r.status == 200, await r.text()
                            return await r.json(), dict(r.headers)

                    await ask("key-a")
                    own, _ = await ask("key-a")
                    hits = prefix_hits()
                    other, headers = await ask("key-b")
                    return own, other, headers, hits, prefix_hits()

    own, other, headers, hits_before, hits_after = asyncio.run(main())
    assert own["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a key shares with itself
    assert hits_before > 0 and hits_after == hits_before  # key b's prompt: no prefix hit anywhere
    assert "prompt_tokens_details" not in other["usage"]
    assert not [h for h in headers if h.lower().startswith("x-tierguard-r")], headers  # no route, no replica
    routed = [json.loads(line).get("routed") for line in log.read_text().splitlines()]
    assert routed[1] == "prefix_hit" and routed[2] != "prefix_hit", routed  # the log keeps why; b: no hit
