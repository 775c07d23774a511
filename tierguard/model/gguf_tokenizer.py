"""Rebuild `tokenizer.json` + `tokenizer_config.json` from a GGUF file's tokenizer keys.

A GGUF stores the vocabulary, merges, token types, special ids and chat template as
metadata under llama.cpp's names. This module turns them back into a fast tokenizer with
the `tokenizers` library, so `HFTokenizer` (and transformers) read the result.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are rebuilt; the
text is split before BPE the way llama.cpp splits it for the file's
`tokenizer.ggml.pre` (its `llama-vocab.cpp` lists the regexes). A pre-tokenizer we do
not know would silently tokenize differently from the model's training, so it is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from tierguard.common.errors import TierguardError
from tierguard.model.gguf_reader import field

# GGUF token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

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
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = field(reader, "tokenizer.ggml.model")
    if model is None:
        raise TierguardError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
    if model != "gpt2":
        raise TierguardError(
            f"GGUF tokenizer model {model!r} is not supported; import-gguf rebuilds byte-level BPE ('gpt2') only"
        )
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

    def token(key: str) -> str | None:
        i = field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
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
    if isinstance(template, str):
        config["chat_template"] = template
    return tok, config


def write_tokenizer(reader, out_dir: Path) -> None:
    tok, config = build_tokenizer(reader)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
