"""The byte rule (tierguard/gate/tokens_fit.py): a lower bound on tokens that really bounds."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from tierguard.gate.tokens_fit import (
    TokenBytes,
    chat_bytes,
    text_bytes,
    token_bytes_from_json,
    token_bytes_of,
)


@pytest.fixture(scope="module")
def tiny():
    from tierguard.model.tiny import ensure_tiny_model
    from tierguard.model.tokenizer import HFTokenizer

    return HFTokenizer(ensure_tiny_model())


def _trained(kind: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    texts = ["hello world, caf\u00e9 na\u00efve", "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0", "def f(x): return x**2",
             "emoji \U0001f600 mix " * 3, "    spaces\n\ttabs  "] * 30
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|a_long_special_token_here|>"])
    elif kind == "sentencepiece":  # Llama-2 style: byte fallback, Prepend + Replace
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"] + [f"<0x{i:02X}>" for i in range(256)])
    else:  # WordLevel over whitespace: drops spaces, an unknown word is one token
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tok.train_from_iterator(texts, trainer)
    return tok


def test_tiny_tokenizer_rule(tiny):
    rule = token_bytes_of(tiny)
    assert rule.exact and rule.max_bytes == len("<|begin_of_text|>")  # the longest entry is an added token
    assert rule.cannot_fit(8192 * rule.max_bytes, 8192) and not rule.cannot_fit(8191 * rule.max_bytes, 8192)
    assert "at least 8192 tokens" in rule.refusal(8192 * rule.max_bytes, 8192)


def test_only_byte_preserving_tokenizers_get_an_exact_rule():
    for kind, exact in (("bytelevel", True), ("sentencepiece", True), ("wordlevel", False)):
        rule = token_bytes_from_json(json.loads(_trained(kind).to_str()))
        assert rule.exact is exact, kind
    not_exact = TokenBytes(4, exact=False)
    assert not not_exact.cannot_fit(10**9, 10)  # no refusal without a proof


_texts = st.text(max_size=300) | st.sampled_from(["x" * 500, " " * 400, "<|begin_of_text|>" * 20, "\U0001f600" * 100,
                                                  "<|im_start|><|im_end|>" * 10, "\u2581" * 50, "\x00" * 30])


@seed(15)
@settings(max_examples=300, deadline=None, database=None)
@given(text=_texts, kind=st.sampled_from(["tiny", "bytelevel", "sentencepiece"]))
def test_the_lower_bound_holds(tiny, text, kind):
    """tokens(text) >= ceil(bytes / L) for every text: the rule never refuses what fits."""
    if kind == "tiny":
        rule, n = token_bytes_of(tiny), len(tiny.encode(text, add_special_tokens=False))
    else:
        tok = _TRAINED.setdefault(kind, _trained(kind))
        rule, n = token_bytes_from_json(json.loads(tok.to_str())), len(tok.encode(text).ids)
    assert n >= rule.min_tokens(text_bytes(text)), (kind, text[:50], n, rule)


_TRAINED: dict = {}


def test_byte_counts_of_shapes_and_the_body_limit():
    assert text_bytes("\u00e9x") == 3 and text_bytes(["ab"]) == 2 and text_bytes([1, 2]) is None
    assert chat_bytes([{"role": "user", "content": "ab"}, {"content": [{"type": "text", "text": "\u00e9"}]}]) == 4
    assert chat_bytes("nope") is None
    rule = TokenBytes(17, exact=True)
    # the longest prompt that fits, spelled the worst way JSON can (\u0001 per byte), is under the limit
    worst = json.dumps({"prompt": "\x01" * (8191 * 17)}).encode()
    assert len(worst) < rule.body_limit(8192)
