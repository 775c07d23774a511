"""Context downgrade: drop the oldest chat turns until the input fits a limit.

Invariants: system messages are never dropped; the last message (the turn being
answered) is never dropped; relative order is kept. If the input still does not fit
after dropping everything droppable, the trim fails and the caller rejects instead —
a downgrade never sends an input larger than the limit it promised.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierguard.gate.tokens import TokenCounter, message_text


@dataclass
class TrimResult:
    messages: list[dict]
    dropped: int  # messages removed
    tokens: int  # input tokens after trimming
    fits: bool


def can_trim(messages: object) -> bool:
    """True when there is at least one droppable turn (not system, not the last)."""
    if not isinstance(messages, list) or len(messages) < 2:
        return False
    return any(isinstance(m, dict) and m.get("role") != "system" for m in messages[:-1])


async def trim_messages(messages: list[dict], limit: int, counter: TokenCounter) -> TrimResult:
    """Drop oldest droppable turns until `counter.count_chat` says the input is <= limit.

    Per-message sizes are estimated from character share of the total (one count call),
    then the result is recounted; a few rounds converge even with a remote tokenizer.
    """
    kept = list(messages)
    dropped = 0
    tokens = await counter.count_chat(kept)
    for _ in range(8):  # each round recounts once; rounds only run while over the limit
        if tokens <= limit:
            return TrimResult(kept, dropped, tokens, True)
        chars = [len(message_text(m)) + 16 for m in kept]
        per_char = tokens / max(1, sum(chars))
        excess = tokens - limit
        removed_tokens = 0.0
        droppable = [i for i, m in enumerate(kept[:-1]) if m.get("role") != "system"]
        if not droppable:
            break
        to_drop: set[int] = set()
        for i in droppable:  # oldest first
            to_drop.add(i)
            removed_tokens += chars[i] * per_char
            if removed_tokens >= excess:
                break
        kept = [m for i, m in enumerate(kept) if i not in to_drop]
        dropped += len(to_drop)
        tokens = await counter.count_chat(kept)
    return TrimResult(kept, dropped, tokens, tokens <= limit)
