"""Rebuild `tokenizer.json` + `tokenizer_config.json` from a GGUF file's tokenizer keys.

A GGUF stores the vocabulary, merges, token types, special ids and chat template as
metadata under llama.cpp's names. This module turns them back into a fast tokenizer with
the `tokenizers` library, so `HFTokenizer` (and transformers) read the result.

Two kinds of vocabulary are rebuilt:
- byte-level BPE (`tokenizer.ggml.model == "gpt2"`): the text is split before BPE the
  way llama.cpp splits it for the file's `tokenizer.ggml.pre` (its `llama-vocab.cpp`
  lists the regexes). A pre-tokenizer we do not know would silently tokenize
  differently from the model's training, so it is refused.
- SentencePiece BPE (`"llama"`), for Gemma 3: spaces become "▁", no pre-split, byte
  fallback through the `<0xNN>` tokens. The file stores no merges; they are rebuilt from
  the vocabulary, each token's splits ranked by the token's priority (see `_sp_merges`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tierguard.common.errors import TierguardError
from tierguard.model.gguf_reader import field

# GGUF token types (gguf.TokenType).
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6
_SPACE = "\u2581"  # SentencePiece's visible space

# The turn format of Gemma's instruction-tuned models, for files that carry no template:
# a system message opens the first user turn; the model's turns are "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] ~ '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != loop.index0 is even %}"
    "{{ raise_exception('conversation roles must alternate user/assistant/user/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (prefix if loop.first else '') ~ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_DEFAULT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split every digit first, the split regex)
PRE_TOKENIZERS = {
    "default": (False, _GPT2_SPLIT),
    "gpt-2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),  # SmolLM/SmolLM2: each digit alone, then GPT-2's split
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """The `tokenizer.ggml.pre` name for a tokenizer.json's pre-tokenizer (export-gguf):
    GPT-2's ByteLevel split, or a Sequence matching an entry of PRE_TOKENIZERS (what
    import-gguf writes, and e.g. SmolLM's Digits + ByteLevel). Anything else: "gpt-2"."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    digits = any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps)
    split = next((s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"), None)
    if split is None and any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
        split = _GPT2_SPLIT
    for name in ("smollm", "llama-bpe", "qwen2", "gpt-2"):
        if PRE_TOKENIZERS[name] == (digits, split):
            return name
    return "gpt-2"


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise TierguardError(
            f"GGUF tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    digits, split = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    return pre_tokenizers.Sequence(steps)


def build_tokenizer(reader):
    """The `tokenizers.Tokenizer` the file describes, and tokenizer_config.json's content."""
    model = field(reader, "tokenizer.ggml.model")
    if model is None:
        raise TierguardError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
    if model == "llama":
        return _sentencepiece(reader)
    if model != "gpt2":
        raise TierguardError(
            f"GGUF tokenizer model {model!r} is not supported; import-gguf rebuilds byte-level BPE ('gpt2') "
            "and SentencePiece BPE ('llama')"
        )
    return _byte_level(reader)


def _byte_level(reader):
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = field(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise TierguardError("GGUF tokenizer lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise TierguardError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(field(reader, "tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
    added = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(added)
    bos, add_bos = _bos(reader, tokens, False)
    if add_bos and bos is not None:
        tok.post_processor = _prepend_bos(bos, vocab[bos])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, _tokenizer_config(reader, tokens, add_bos)


def _token(reader, tokens: list[str], key: str) -> str | None:
    i = field(reader, f"tokenizer.ggml.{key}")
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None


def _bos(reader, tokens: list[str], default: bool) -> tuple[str | None, bool]:
    return _token(reader, tokens, "bos_token_id"), bool(field(reader, "tokenizer.ggml.add_bos_token", default))


def _prepend_bos(bos: str, bos_id: int):
    from tokenizers import processors

    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


def _tokenizer_config(reader, tokens: list[str], add_bos: bool) -> dict:
    def token(key: str) -> str | None:
        return _token(reader, tokens, key)

    bos, eos = token("bos_token_id"), token("eos_token_id")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": add_bos,
        "model_max_length": int(field(reader, f"{field(reader, 'general.architecture')}.context_length") or 2048),
        "clean_up_tokenization_spaces": False,
    }
    template = field(reader, "tokenizer.chat_template")
    if not isinstance(template, str):
        template = _DEFAULT_TEMPLATES.get(str(field(reader, "general.architecture")))
    if isinstance(template, str):
        config["chat_template"] = template
    return config


def _sentencepiece(reader):
    """SentencePiece BPE with byte fallback (Gemma): the vocabulary with its scores and
    token types; merges rebuilt (`_sp_merges`); control tokens special, user-defined
    ones matched whole; BOS prepended when the file says so."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise TierguardError("GGUF tokenizer lacks tokenizer.ggml.tokens")
    scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = field(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if not len(scores) == len(types) == len(tokens):
        raise TierguardError(
            f"GGUF tokenizer has {len(tokens)} tokens, {len(scores)} scores and {len(types)} token types"
        )
    if not any(t == _BYTE for t in types):
        raise TierguardError("GGUF SentencePiece tokenizer has no <0xNN> byte tokens to fall back on")
    # A run of spaces is stored with real spaces; the normalizer turns spaces into "▁"
    # before lookup, so such a token is spelled with "▁" to stay reachable.
    spelled = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    unk = _token(reader, tokens, "unknown_token_id") or "<unk>"
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_sp_merges(spelled, scores, types, vocab),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, s, k in zip(tokens, spelled, types, strict=True)
            if k == _USER_DEFINED and t == s
        ]
    )
    bos, add_bos = _bos(reader, tokens, True)  # llama.cpp adds BOS unless the file says otherwise
    if add_bos and bos is not None:
        tok.post_processor = _prepend_bos(bos, vocab[bos])
    return tok, _tokenizer_config(reader, tokens, add_bos)


def _sp_merges(spelled: list[str], scores: list[float], types: list[int], vocab: dict[str, int]) -> list:
    """BPE merges that rebuild SentencePiece's choices: every way to split a token into two
    vocabulary pieces is a merge, ranked by the token it makes. User-defined and control
    pieces rank first, in file order (SentencePiece matches them before any merge); then
    normal tokens by score, best first (Gemma's scores fall with the token id, so ties
    keep file order). Splits of one token: the longer left piece first."""

    def rank(i: int) -> tuple:
        return (0, 0.0, i) if types[i] in (_CONTROL, _USER_DEFINED) else (1, -float(scores[i]), i)

    merges = []
    for i in sorted((i for i, k in enumerate(types) if k != _BYTE), key=rank):
        piece = spelled[i]
        splits = [(piece[:j], piece[j:]) for j in range(len(piece) - 1, 0, -1)]
        merges += [(a, b) for a, b in splits if a in vocab and b in vocab]
    return merges


def write_tokenizer(reader, out_dir: Path) -> None:
    tok, config = build_tokenizer(reader)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
