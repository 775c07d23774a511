"""An upper bound on input tokens from UTF-8 byte counts, without tokenizing.

The assumption (documented in `tierguard gate --help` and the README): every token the
tokenizer emits for user text covers at least one byte of it. That holds for
byte-level BPE (GPT-2/Llama-3/Qwen style: the vocabulary is built over bytes), for
SentencePiece with byte fallback (a missing character becomes at most its own bytes)
and for WordPiece/Unigram (each piece is at least one character). What it does not
cover is text the tokenizer or template adds on its own: BOS/EOS, a dummy prefix
space, role markers, a default system prompt. Those are bounded by fixed slacks:

    tokens(text) <= utf8_bytes(text) + TEXT_SLACK_TOKENS
    tokens(chat) <= sum(utf8_bytes(role) + utf8_bytes(content) + PER_MESSAGE_SLACK_TOKENS)
                    + CHAT_SLACK_TOKENS

Requests whose shape the bound cannot vouch for (tools, images or other non-text
parts, token-id lists mixed with text) get no bound and are counted exactly.
`--exact-token-count` turns the bound off entirely.
"""

from __future__ import annotations

TEXT_SLACK_TOKENS = 8  # BOS/EOS and a dummy-prefix token around one text
PER_MESSAGE_SLACK_TOKENS = 16  # role markers and separators around one chat message
CHAT_SLACK_TOKENS = 256  # fixed template text: a default system prompt, the generation prompt
# Checked against the upstream's /tokenize at start: ASCII, accents, CJK and an emoji.
PROBE_TEXT = "probe: tokens <= bytes? caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f600 1234567890"
_PLAIN_KEYS = frozenset(("role", "content", "name"))  # message keys the bound covers
_CHAT_ONLY_FIELDS = ("tools", "functions", "tool_choice", "documents")  # rendered by templates too


def utf8_len(text: str) -> int:
    """UTF-8 byte length; ASCII (the common case) is measured without encoding."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def byte_bound(body: dict, chat: bool) -> int | None:
    """An upper bound on the input tokens of `body`, or None when none is safe."""
    if chat:
        if any(body.get(k) for k in _CHAT_ONLY_FIELDS):
            return None
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        total = CHAT_SLACK_TOKENS
        for m in messages:
            if not isinstance(m, dict):
                return None
            if not _PLAIN_KEYS.issuperset(m):
                return None  # tool calls and other structure a template renders: count exactly
            texts = [m.get(k) or "" for k in _PLAIN_KEYS]
            if not all(isinstance(t, str) for t in texts):
                return None  # multi-part content (images): count exactly
            total += sum(utf8_len(t) for t in texts) + PER_MESSAGE_SLACK_TOKENS
        return total
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return utf8_len(prompt) + TEXT_SLACK_TOKENS
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return sum(utf8_len(p) + TEXT_SLACK_TOKENS for p in prompt)
    return None  # token ids are counted by length anyway; odd shapes are counted exactly


def is_byte_level(tokenizer_json: dict) -> bool:
    """True when a tokenizer.json describes a byte-level BPE: a ByteLevel pre-tokenizer or
    decoder, or a BPE model with byte fallback. Anything else keeps exact counting."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return True
    if model.get("type") not in (None, "BPE"):
        return False
    return any(has_type(tokenizer_json.get(k), "ByteLevel") for k in ("pre_tokenizer", "decoder"))


def has_type(node: object, name: str) -> bool:
    if isinstance(node, dict):
        return node.get("type") == name or any(has_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(has_type(v, name) for v in node)
    return False
