"""The byte-bound shortcut: surely-short requests skip the token count, near-limit ones don't."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from tests.gate.helpers import GateProcess, get_json, run, stream_request
from tierguard.bench.schedule_server import ScheduleServer
from tierguard.gate.tokens import LocalTokenizer, TokenCounter
from tierguard.gate.tokens_bound import CHAT_SLACK_TOKENS, TEXT_SLACK_TOKENS, byte_bound, is_byte_level

_TEXTS = ["hello world", "caf\u00e9 na\u00efve r\u00e9sum\u00e9", "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0",
          "emoji \U0001f600\U0001f680 mix", "code: def f(x): return x**2 # \u00b5s", "    spaces\n\ttabs  "]


def _save_tokenizer(directory, byte_level: bool) -> None:
    """A tiny trained tokenizer.json: byte-level BPE, or a whitespace WordLevel (not byte-level)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tok.train_from_iterator(_TEXTS * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))


def test_byte_bound_shapes():
    assert byte_bound({"prompt": "abc"}, chat=False) == 3 + TEXT_SLACK_TOKENS
    assert byte_bound({"prompt": "\u00e9"}, chat=False) == 2 + TEXT_SLACK_TOKENS  # UTF-8 bytes, not characters
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert byte_bound(chat, chat=True) > CHAT_SLACK_TOKENS
    # shapes the bound cannot vouch for are counted exactly
    assert byte_bound({"prompt": [1, 2, 3]}, chat=False) is None
    assert byte_bound({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, chat=True) is None
    assert byte_bound({**chat, "tools": [{"type": "function"}]}, chat=True) is None
    assert byte_bound({"messages": [{"role": "assistant", "tool_calls": []}]}, chat=True) is None


def test_local_byte_level_bound_holds_and_skips_counting(tmp_path):
    _save_tokenizer(tmp_path / "bl", byte_level=True)
    _save_tokenizer(tmp_path / "wl", byte_level=False)
    assert is_byte_level(json.loads((tmp_path / "bl" / "tokenizer.json").read_text()))
    assert not is_byte_level(json.loads((tmp_path / "wl" / "tokenizer.json").read_text()))
    tok = LocalTokenizer(str(tmp_path / "bl"))
    rng = random.Random(0)
    for _ in range(200):  # the bound really bounds this tokenizer's exact counts
        text = "".join(rng.choice(_TEXTS) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 6)))
        chat = rng.random() < 0.5
        body = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]} \
            if chat else {"prompt": text}
        assert asyncio.run(tok.count_body(body, chat)) <= byte_bound(body, chat)

    short = {"prompt": "hello world"}
    got = asyncio.run(tok.count_for_admission(short, chat=False, limit=100))
    assert got.method == "byte_bound" and tok.bound_skips == 1 and tok.exact_counts == 0
    near = {"prompt": "hello world " * 8}  # 96 bytes + slack >= 100: could be long, so it is counted
    got = asyncio.run(tok.count_for_admission(near, chat=False, limit=100))
    assert got.method == "exact" and tok.exact_counts == 1
    assert got.tokens == asyncio.run(tok.count_body(near, chat=False))
    # a tokenizer that is not byte-level is always counted exactly; so is --exact-token-count
    for exact in (LocalTokenizer(str(tmp_path / "wl")), LocalTokenizer(str(tmp_path / "bl"), use_byte_bound=False)):
        got = asyncio.run(exact.count_for_admission(short, chat=False, limit=100))
        assert got.method == "exact" and exact.bound_skips == 0 and exact.exact_counts == 1


def test_estimate_counter_never_claims_exact():
    c = TokenCounter()
    got = asyncio.run(c.count_for_admission({"prompt": "x" * 40}, chat=False, limit=100))
    assert got.method == "estimate" and got.tokens == 10 and c.exact_counts == c.bound_skips == 0


async def _tokenize_calls(s: aiohttp.ClientSession, up: str) -> int:
    async with s.get(up + "/metrics") as r:
        text = await r.text()
    return int(next(ln for ln in text.splitlines() if ln.startswith("schedule_tokenize_requests_total")).split()[1])


@pytest.mark.parametrize("exact", [False, True])
def test_upstream_tokenize_only_near_the_limit(tmp_path, exact):
    log = tmp_path / "req.jsonl"
    flags = ["--long-threshold", "100", "--max-long", "1"] + (["--exact-token-count"] if exact else [])
    with ScheduleServer(ttft_ms=5, itl_ms=5, output_tokens=3) as up, \
            GateProcess(up.base_url, *flags, jobs_dir=tmp_path / "jobs", log=log) as gate:
        async def main():
            async with aiohttp.ClientSession() as s:
                url = gate.url + "/v1/completions"
                calls0 = await _tokenize_calls(s, up.base_url)  # the start-up probe
                short = await stream_request(s, url, {"prompt": "hello there", "stream": True})
                after_short = await _tokenize_calls(s, up.base_url)
                # 50 words = 100 bytes: the bound cannot rule out "long", so it is counted (50 tokens: short)
                near = await stream_request(s, url, {"prompt": "w " * 50, "stream": True})
                long = await stream_request(s, url, {"prompt": "word " * 150})  # 150 tokens: long
                after = await _tokenize_calls(s, up.base_url)
                # not counted, then the upstream's usage.prompt_tokens fills in the log
                await stream_request(s, url, {"prompt": "a b c"})
                _, health = await get_json(s, gate.url + "/health")
                return short, near, long, calls0, after_short, after, health

        short, near, long, calls0, after_short, after, health = run(main())
    assert short["headers"]["X-Tierguard-Class"] == near["headers"]["X-Tierguard-Class"] == "interactive"
    assert long["headers"]["X-Tierguard-Class"] == "long"
    assert after_short - calls0 == (1 if exact else 0)  # the short request made no round trip
    assert after - after_short == 2  # both near-limit requests were counted by the upstream
    assert health["token_counts"] == {"exact": 4 if exact else 2, "byte_bound": 0 if exact else 2}
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["token_count"] for x in lines] == (["exact"] * 4 if exact else
                                                 ["byte_bound", "exact", "exact", "upstream_usage"])
    assert [x["input_tokens"] for x in lines][1:] == [50, 150, 3]
