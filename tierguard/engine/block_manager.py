"""Sequences' block tables on top of the block pool, with prefix caching.

The manager owns the policy of which blocks a sequence holds; the pool (block_pool.py)
owns their states, and prefix_hash.py their content hashes. A prefix-cache lookup only
reads; admission then takes references. A block is published under its hash only after
its KV has been computed, so a hit never reads KV that is still being written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierguard.engine.block_pool import BlockPool
from tierguard.engine.prefix_hash import block_hash, prefix_block_hashes
from tierguard.engine.sequence import Sequence


@dataclass
class PrefixMatch:
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    num_revived: int = 0  # hits that sit in the cached-free state (they leave the free count)
    # Hashes of the full blocks after the first device miss, in order: the KV connector
    # looks these up in host RAM and the cold tiers to extend the match.
    missed_hashes: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(
        self, pool: BlockPool, block_size: int, fingerprint: int, enable_prefix_caching: bool = True
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    def _tokens_of_block(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def lookup(self, seq: Sequence) -> PrefixMatch:
        """Longest run of cached full blocks at the start of `seq`. Does not modify state.

        The last token is never matched: its logits are needed to sample, so at least one
        token is always computed.
        """
        match = PrefixMatch()
        if not self.enable_prefix_caching:
            return match
        limit = (len(seq) - 1) // self.block_size
        hashes = self._prefix_hashes(seq, limit)
        for i, h in enumerate(hashes):
            block_id = self.pool.lookup(h, self._tokens_of_block(seq, i))
            if block_id is None:
                # After the first miss every later block is a miss on the device (chained hashes).
                match.missed_hashes = hashes[i:]
                break
            match.block_ids.append(block_id)
            match.hashes.append(h)
            match.num_revived += self.pool.is_cached_free(block_id)
        return match

    def _prefix_hashes(self, seq: Sequence, limit: int) -> list[int]:
        """The first `limit` full blocks' chained hashes, computed once per sequence: a
        request waiting for room is looked up every step, and its tokens only grow."""
        cache = seq.prefix_hashes
        if len(cache) < limit:
            parent = cache[-1] if cache else None
            cache += prefix_block_hashes(
                seq.token_ids, self.block_size, self.fingerprint, len(cache), parent, limit - len(cache)
            )
        return cache[:limit]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        have = max(len(seq.block_table), num_cached_blocks)
        base = max(seq.num_computed_tokens, num_cached_blocks * self.block_size)
        return max(0, -(-(base + num_new_tokens) // self.block_size) - have)

    def can_admit(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int, reserve: int = 0) -> bool:
        """True if admission leaves at least `reserve` blocks free (headroom for decodes)."""
        need = self.blocks_needed(seq, num_new_tokens, len(match.block_ids))
        return need + reserve <= self.pool.num_free - match.num_revived

    def admit(self, seq: Sequence, match: PrefixMatch) -> None:
        """Take references on the matched blocks; they become the start of the table."""
        for block_id in match.block_ids:
            self.pool.acquire(block_id)
        seq.block_table = list(match.block_ids)
        seq.block_hashes = list(match.hashes)
        seq.num_computed_tokens = len(match.block_ids) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += len(seq)
            self.prefix_hits += seq.num_computed_tokens

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the table to cover num_computed + num_new_tokens; all or nothing."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.pool.num_free:
            return False
        for _ in range(need):
            seq.block_table.append(self.pool.allocate())
        return True

    def free(self, seq: Sequence) -> None:
        """Release all of a sequence's blocks, tail first, so that on eviction the tail
        of a prefix goes before its head (the head is the likelier to be shared)."""
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)
        seq.block_table = []
        seq.block_hashes = []

    def register_computed(self, seq: Sequence) -> None:
        """Publish the full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[i - 1] if i else self.fingerprint
            tokens = self._tokens_of_block(seq, i)
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            self.pool.register(seq.block_table[i], h, tokens)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
