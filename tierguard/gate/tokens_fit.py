"""A lower bound on tokens from UTF-8 byte counts: refuse what cannot fit, before tokenizing.

`tokens_bound.py` bounds input tokens from above (to skip counts of surely short
requests); this module bounds them from below, so a request that can never fit the
context is refused without running the tokenizer at all. Tokenizing is the expensive
part: a 30 MB prompt held the tiny model's server for more than a minute and grew it
by gigabytes before its 400 came back.

The rule (also in docs/hardening.md):

    L = the most UTF-8 bytes of input that one token of this tokenizer can stand for
        (the longest vocabulary entry, added tokens included)
    tokens(text) >= ceil(utf8_bytes(text) / L)
    refuse when ceil(utf8_bytes(prompt) / L) >= max_model_len   (no room for any output)

For chat the bytes are the sum of the message contents (the template only adds tokens).
It holds when every input byte ends up in some token: byte-level BPE, or BPE with byte
fallback, with no normalizer that can shrink text (only Prepend/Replace) and no
pre-tokenizer that drops text (Whitespace and friends do). For any other tokenizer
`exact` is False and nothing is refused by this rule; the body limit below still
bounds the work.

The default body limit follows from the same numbers: a prompt that fits has at most
`max_model_len * L` bytes, JSON may spell a byte as up to 6 (`\\u0001`), and a chat of
one-token messages carries some structure per message:

    body_limit = max_model_len * (6 * L + 64) + 64 KiB
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tierguard.gate.tokens_bound import has_type, is_byte_level, utf8_len

JSON_BYTES_PER_BYTE = 6  # the worst JSON spelling of one input byte: \u00XX
STRUCTURE_BYTES_PER_TOKEN = 64  # {"role":"user","content":"x"}, per one-token message
BODY_SLACK_BYTES = 64 * 1024  # the other fields: model, sampling options, stop strings
_SAFE_NORMALIZERS = frozenset(("Prepend", "Replace"))
_SAFE_PRE_TOKENIZERS = frozenset(("ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"))


@dataclass(frozen=True)
class TokenBytes:
    """The most input bytes one token covers (`max_bytes`), and whether the lower bound
    built on it is proven for this tokenizer (`exact`)."""

    max_bytes: int
    exact: bool
    source: str = ""

    def min_tokens(self, nbytes: int) -> int:
        return -(-nbytes // self.max_bytes)

    def cannot_fit(self, nbytes: int, max_model_len: int) -> bool:
        """True when a text of `nbytes` bytes surely leaves no room for output."""
        return self.exact and self.min_tokens(nbytes) >= max_model_len

    def refusal(self, nbytes: int, max_model_len: int) -> str:
        return (
            f"This model's maximum context length is {max_model_len} tokens, but the prompt is {nbytes} "
            f"bytes: at least {self.min_tokens(nbytes)} tokens with this tokenizer (no token covers more "
            f"than {self.max_bytes} bytes), so it was refused before tokenizing. Shorten the prompt."
        )

    def body_limit(self, max_model_len: int) -> int:
        return max_model_len * (JSON_BYTES_PER_BYTE * self.max_bytes + STRUCTURE_BYTES_PER_TOKEN) + BODY_SLACK_BYTES


def text_bytes(prompt: object) -> int | None:
    """UTF-8 bytes of a completion prompt (a string or a one-element list of strings)."""
    if isinstance(prompt, str):
        return utf8_len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return utf8_len(prompt[0])
    return None


def chat_bytes(messages: object) -> int | None:
    """UTF-8 bytes of all message contents (text parts of multi-part contents included)."""
    if not isinstance(messages, list):
        return None
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, str):
            total += utf8_len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
                if isinstance(text, str):
                    total += utf8_len(text)
    return total


def token_bytes_from_json(tok: dict, vocab: dict[str, int] | None = None) -> TokenBytes:
    """The rule for a `tokenizer.json` (parsed). `vocab` may add tokens the JSON lacks."""
    model = tok.get("model") or {}
    pieces = model.get("vocab") or {}
    names = list(pieces) if isinstance(pieces, dict) else [p[0] for p in pieces if isinstance(p, list) and p]
    names += [t.get("content", "") for t in tok.get("added_tokens") or []]
    names += list(vocab or ())
    byte_level = has_type(tok.get("pre_tokenizer"), "ByteLevel") or has_type(tok.get("decoder"), "ByteLevel")
    longest = max((_token_bytes(n, byte_level) for n in names), default=1)
    exact = (
        is_byte_level(tok)
        and _only(tok.get("normalizer"), _SAFE_NORMALIZERS)
        and _only(tok.get("pre_tokenizer"), _SAFE_PRE_TOKENIZERS)
        and not any(t.get("lstrip") or t.get("rstrip") for t in tok.get("added_tokens") or [])
    )
    return TokenBytes(max(1, longest), exact, "byte-level" if exact else "not byte-preserving: no byte rule")


def token_bytes_of(tokenizer: object) -> TokenBytes | None:
    """The rule for a tokenizer object: a `tokenizers.Tokenizer`, or one exposing it as
    `backend` (our HFTokenizer). None for anything else (then no byte rule applies)."""
    backend = getattr(tokenizer, "backend", tokenizer)
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True) if hasattr(backend, "get_vocab") else None
    return token_bytes_from_json(json.loads(to_str()), vocab)


def _token_bytes(piece: str, byte_level: bool) -> int:
    if byte_level:
        return len(piece)  # the byte-level alphabet spells every byte as one character
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
        return 1  # a byte-fallback token
    return len(piece.replace("\u2581", " ").encode("utf-8", "surrogatepass"))


def _only(node: object, allowed: frozenset[str]) -> bool:
    """True when `node` is absent, or every step in it (through Sequences) is allowed."""
    if node is None:
        return True
    if not isinstance(node, dict):
        return False
    kind = node.get("type")
    if kind == "Sequence":
        steps = node.get("normalizers") or node.get("pretokenizers") or []
        return all(_only(s, allowed) for s in steps)
    if kind == "Split" and str(node.get("behavior", "")).lower() == "removed":
        return False
    if kind == "Replace":
        pattern = node.get("pattern") or {}
        old = pattern.get("String") if isinstance(pattern, dict) else None
        return isinstance(old, str) and utf8_len(node.get("content") or "") >= utf8_len(old) > 0
    return kind in allowed

