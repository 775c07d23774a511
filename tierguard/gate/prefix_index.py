"""Which replica likely holds a request's prefix: a bounded, approximate index (no HTTP).

The gate cannot see the replicas' KV caches; it remembers what it sent where. A
prompt is rendered to text (chat: role markers + contents, in order, the way every
chat template lays turns out), cut into fixed-size chunks and hashed in a chain,
h_i = xxh64(h_{i-1} || chunk_i), as the engines hash their KV blocks, from a start
that is the request's `cache_salt` (per-tenant isolation: tenants share no entry). Two prompts
share the first k chained hashes exactly when they share the first k chunks, so the
number of leading hashes a replica was sent is how much of the prompt it may still
hold. Only full chunks count (a partial last chunk is not a reusable block either).

Why text chunks, not token blocks: the gate proves most requests short from their
byte count without tokenizing them (`tokens_bound.py`); tokenizing every prompt only
to route it would put the tokenizer pool on the path of every request. A chunk of
`chunk_chars` characters is a few engine blocks; the score is a share, so the unit
cancels out.

Bounds: at most `max_entries` chained hashes (LRU; one entry is an 8-byte key and a
small list), and at most `max_chunks` chunks hashed per request, so the work per
request is bounded whatever its size (prefixes longer than that score on their head).

Forgetting a replica (it restarted, its cache is empty) is O(1): each entry carries
the sequence number of its last update and each replica the sequence at which it was
forgotten; a bit older than that is stale and is cleared when its entry is next
touched.

    index = PrefixIndex(n_replicas=2)
    keys = index.keys(render_chat(messages))
    index.matched(keys)      # -> [chunks replica 0 holds, chunks replica 1 holds]
    index.record(keys, 1)    # the request went to replica 1
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash

CHUNK_CHARS = 256  # about 64 tokens of English text: four 16-token engine blocks
MAX_CHUNKS = 1024  # 256 KiB of text hashed at most per request
MAX_ENTRIES = 65536  # chunk hashes remembered across all replicas (a few MiB)


def render_chat(messages: object) -> str:
    """A chat as one text in turn order, the way chat templates lay it out.

    Exact template tokens do not matter for routing: two chats sharing their first
    turns render to texts sharing their first characters, which is all the index needs.
    """
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', '')}|>\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def render_prompt(prompt: object) -> str:
    """A completions prompt as text: a string, or the first of a list of strings."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:8]):
        return ",".join(map(str, prompt))  # token ids: their text form chunks just as well
    return ""


class PrefixIndex:
    """Chained chunk hashes -> the replicas they were sent to. Single event loop; not thread-safe."""

    def __init__(self, n_replicas: int, chunk_chars: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS,
                 max_entries: int = MAX_ENTRIES) -> None:
        if n_replicas < 1 or chunk_chars < 1 or max_chunks < 1 or max_entries < 1:
            raise ValueError("PrefixIndex sizes must be positive")
        self.n = n_replicas
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.max_entries = max_entries
        # hash -> [replica bit mask, sequence of the last update]
        self._entries: OrderedDict[int, list[int]] = OrderedDict()
        self._forgotten = [0] * n_replicas  # sequence at which each replica was last forgotten
        self._seq = 1
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self, text: str, salt: str | None = None) -> list[int]:
        """The chained hashes of the full chunks of `text` (at most `max_chunks`). The
        chain starts from the request's `cache_salt`, as the engines' block hashes do, so
        requests of different salts never match each other's entries (isolation.py)."""
        size = self.chunk_chars
        n = min(len(text) // size, self.max_chunks)
        out = []
        h = xxhash.xxh64_intdigest(salt.encode("utf-8", "surrogatepass"), seed=1) if salt else 0
        for i in range(n):
            h = xxhash.xxh64_intdigest(text[i * size:(i + 1) * size].encode("utf-8", "surrogatepass"), seed=h)
            out.append(h)
        return out

    def matched(self, keys: Sequence[int]) -> list[int]:
        """For each replica, how many leading chunks of `keys` were sent to it.

        Does not change the index (no LRU touch): a lookup is not a use.
        """
        counts = [0] * self.n
        alive = (1 << self.n) - 1
        for k in keys:
            entry = self._entries.get(k)
            if entry is None:
                break
            alive &= self._valid_mask(entry)
            if not alive:
                break
            for r in range(self.n):
                if alive >> r & 1:
                    counts[r] += 1
        return counts

    def record(self, keys: Sequence[int], replica: int) -> None:
        """`replica` was sent a prompt with these chunks: it holds them now (until evicted)."""
        bit = 1 << replica
        seq = self._seq = self._seq + 1
        entries = self._entries
        for k in keys:
            entry = entries.get(k)
            if entry is None:
                entries[k] = [bit, seq]
            else:
                entry[0] = self._valid_mask(entry) | bit
                entry[1] = seq
                entries.move_to_end(k)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
            self.evictions += 1

    def forget(self, replica: int) -> None:
        """`replica` lost its cache (ejected, restarted): none of its bits count any more."""
        self._seq += 1
        self._forgotten[replica] = self._seq

    def _valid_mask(self, entry: list[int]) -> int:
        mask, seq = entry
        for r, gone in enumerate(self._forgotten):
            if gone and seq < gone:
                mask &= ~(1 << r)
        return mask

    def check_integrity(self) -> None:
        """At most `max_entries` entries; masks name existing replicas only (tests call it)."""
        if len(self._entries) > self.max_entries:
            raise RuntimeError(f"{len(self._entries)} entries over the bound {self.max_entries}")
        top = 1 << self.n
        for mask, _ in self._entries.values():
            if mask <= 0 or mask >= top:
                raise RuntimeError(f"bad replica mask {mask:b}")
