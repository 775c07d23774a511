"""Incremental detokenization and stop-string detection for one request.

Text is decoded over a short sliding window of ids (not the whole output each time),
and only once the window no longer ends in an incomplete UTF-8 sequence. Text that could
still turn out to be the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from tierguard.engine.api import Tokenizer

_CONTEXT = 4  # prompt tokens decoded with the first outputs, so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all output text so far (cut at a stop string once found)
        self.emitted = 0  # characters of self.text already handed out

    def add(self, token_id: int) -> bool:
        """Append one token's text; returns True when a stop string was found."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        old_len = len(self.text)
        self.text += delta
        if not self.stop:
            return False
        search_from = max(0, old_len - self.hold)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def take(self, finished: bool) -> str:
        """Text not handed out yet; keeps back a possible stop-string prefix unless finished."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
