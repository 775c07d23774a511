"""Server-sent events → timed token chunks, without a JSON parse per chunk.

`SSEAccumulator.feed(bytes, now)` is the hot path: called once per network read with the
read's timestamp. It splits `data:` lines and scans each payload with regular
expressions on bytes: the cumulative `completion_tokens` of continuous usage stats
(vLLM's `stream_options.continuous_usage_stats`) gives the tokens per chunk exactly; when
a server sends no usage, the chunk's text is kept and counted after the run
(`resolve_token_counts`). Only payloads that mention "error" are fully parsed.
"""

from __future__ import annotations

import json
import re

from tierguard.bench.records import FAILED, OK, RequestRecord

_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_TEXT = re.compile(rb'"(?:text|content)"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ID = re.compile(rb'"id"\s*:\s*"([^"]*)"')


class SSEAccumulator:
    """Feeds one response body into a `RequestRecord` (times relative to t0)."""

    __slots__ = ("rec", "buf", "last_ct", "usage_total", "saw_data", "done", "failed", "texts", "end")

    def __init__(self, rec: RequestRecord) -> None:
        self.rec = rec
        self.buf = b""
        self.last_ct = 0
        self.usage_total: int | None = None
        self.saw_data = self.done = self.failed = False
        self.texts: list[bytes] = []  # raw escaped text per token chunk, b"" when usage counted it
        self.end: float | None = None

    def feed(self, data: bytes, now: float) -> bool:
        """Consume bytes read at `now`; True once the stream is over ([DONE] or error)."""
        buf = self.buf + data if self.buf else data
        if b"\n" not in data:
            self.buf = buf
            return False
        lines = buf.split(b"\n")
        self.buf = lines.pop()
        rec = self.rec
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            self.saw_data = True
            if payload == b"[DONE]":
                self.done, self.end = True, now
                return True
            if b'"error"' in payload and _is_error(payload):
                rec.status, rec.error = FAILED, f"error event: {error_message(payload.decode('utf-8', 'replace'))}"
                self.failed = self.done = True
                self.end = now
                return True
            if rec.response_id is None:
                m = _ID.search(payload)
                rec.response_id = m.group(1).decode() if m else ""
            m = _COMPLETION.search(payload)
            if m is not None:
                if rec.prompt_tokens is None:
                    p = _PROMPT.search(payload)
                    rec.prompt_tokens = int(p.group(1)) if p else None
                ct = int(m.group(1))
                if b'"choices": []' in payload or b'"choices":[]' in payload:
                    self.usage_total = ct  # the closing usage summary, not a token chunk
                    continue
                if ct > self.last_ct:
                    rec.chunk_times_s.append(now)
                    rec.chunk_tokens.append(ct - self.last_ct)
                    self.texts.append(b"")
                    self.last_ct = ct
                continue
            t = _TEXT.search(payload)
            if t is not None and t.group(1):
                rec.chunk_times_s.append(now)
                rec.chunk_tokens.append(0)  # resolved after the run (tokenizer or usage total)
                self.texts.append(t.group(1))
        return False

    def finish(self, end: float, content_type: str) -> None:
        """Close the record after the body ended at `end`."""
        rec = self.rec
        rec.end_s = self.end if self.end is not None else end
        if self.failed:
            return
        if not self.saw_data:
            rec.status, rec.error = FAILED, f"response is not an SSE stream (Content-Type {content_type or '?'})"
            return
        if not rec.chunk_times_s:
            rec.status, rec.error = FAILED, "stream ended without any token"
            return
        rec.status = OK
        rec.first_token_s = rec.chunk_times_s[0]
        rec.output_tokens = self.usage_total if self.usage_total is not None else sum(rec.chunk_tokens)
        if 0 in rec.chunk_tokens:
            rec._texts = self.texts  # type: ignore[attr-defined]
            rec._usage_total = self.usage_total  # type: ignore[attr-defined]


def _is_error(payload: bytes) -> bool:
    try:
        obj = json.loads(payload)
    except ValueError:
        return False
    return isinstance(obj, dict) and ("error" in obj or obj.get("object") == "error")


def error_message(text: str) -> str:
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") if isinstance(err, dict) else str(err)
        return str(msg or text)[:300]
    except ValueError:
        return " ".join(text.split())[:300] or "(empty body)"


def resolve_token_counts(rec: RequestRecord, counter=None) -> None:
    """Fill in tokens per chunk for chunks that carried text but no usage delta.

    `counter(texts) -> counts` is the tokenizer's chunk counter when one is loaded.
    Otherwise a final usage total is spread over chunks by text length, and without
    even that every chunk counts as one token (what chunk-counting tools assume; the
    record says which source was used).
    """
    toks = rec.chunk_tokens
    if not toks:
        return
    if 0 not in toks:
        rec.token_count_source = rec.token_count_source or "usage_delta"
        rec.output_tokens = max(rec.output_tokens, sum(toks))
        return
    raw = getattr(rec, "_texts", [b""] * len(toks))
    texts = [json.loads(b'"' + r + b'"') if r else "" for r in raw]
    total = getattr(rec, "_usage_total", None)
    if counter is not None:
        counts, source = counter(texts), "tokenizer"
    elif total:
        counts, source = _spread(total, [max(1, len(t)) for t in texts]), "usage_total"
    else:
        counts, source = [1] * len(toks), "chunk_count"
    keep = [i for i, c in enumerate(counts) if c > 0 or toks[i] > 0]
    rec.chunk_times_s = [rec.chunk_times_s[i] for i in keep]
    rec.chunk_tokens = [toks[i] or counts[i] for i in keep]
    rec.token_count_source = source
    rec.output_tokens = total if total else sum(rec.chunk_tokens)
    if rec.chunk_times_s:
        rec.first_token_s = rec.chunk_times_s[0]
    for attr in ("_texts", "_usage_total"):
        rec.__dict__.pop(attr, None)


def _spread(total: int, weights: list[int]) -> list[int]:
    """Integer shares of `total` proportional to `weights` (largest remainder)."""
    if total == len(weights):
        return [1] * len(weights)
    w = sum(weights)
    raw = [total * x / w for x in weights]
    out = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out
