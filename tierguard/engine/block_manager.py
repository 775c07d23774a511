"""Sequences' block tables on top of the block pool, with prefix caching.

The manager owns the policy of which blocks a sequence holds; the pool (block_pool.py)
owns their states, and prefix_hash.py their content hashes. A prefix-cache lookup only
reads; admission then takes references. A block is published under its hash only after
its KV has been computed, so a hit never reads KV that is still being written.

Layer groups (tierguard/kv/groups.py; one group unless the model has sliding-window
layers): a sequence holds one table per group, all of one length. A sliding group's
blocks that fall wholly before its window are released as the sequence runs
(`trim_window`, after every step and before every allocation), as vLLM's hybrid
allocator does; released full blocks stay in the prefix cache under the group's key.
A prefix hit of n blocks needs all n blocks of every full group and, of a sliding
group, only the blocks its window reaches from position n * block_size on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierguard.engine.block_pool import BlockPool
from tierguard.engine.prefix_hash import block_hash, prefix_block_hashes, root_hash
from tierguard.engine.sequence import Sequence
from tierguard.kv.groups import NULL_BLOCK, KVGroups, group_key


@dataclass
class PrefixMatch:
    block_ids: list[int] = field(default_factory=list)  # group 0's hits
    hashes: list[int] = field(default_factory=list)
    num_revived: int = 0  # hits that sit in the cached-free state (they leave the free count)
    # Hashes of the full blocks after the device match, in order: the KV connector looks
    # these up in host RAM and the cold tiers to extend the match.
    missed_hashes: list[int] = field(default_factory=list)
    # Groups 1.. (layer groups only): hits aligned with block_ids, NULL_BLOCK where the
    # group's window does not reach.
    group_ids: list[list[int]] = field(default_factory=list)

    def device_blocks(self) -> list[int]:
        """Every block of the match, all groups (what admission takes references on)."""
        return self.block_ids + [b for ids in self.group_ids for b in ids if b != NULL_BLOCK]


class BlockManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        fingerprint: int,
        enable_prefix_caching: bool = True,
        groups: KVGroups | None = None,
        max_chunk: int = 0,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups
        self.num_groups = groups.num_groups if groups is not None else 1
        # Most blocks a sliding group adds over any run of steps of at most `max_chunk`
        # tokens: its window plus one chunk (what it holds at the peak).
        self._window_cap = [
            0 if groups is None or not grp.sliding else groups.group_blocks(g, 1 << 62, max_chunk, block_size)
            for g, grp in enumerate(groups.groups if groups is not None else [None])
        ]
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
                break
            match.block_ids.append(block_id)
        n = len(match.block_ids)
        if self.num_groups > 1:
            n, match.group_ids = self._group_hits(seq, hashes, n)
            del match.block_ids[n:]
        match.hashes = hashes[:n]
        match.missed_hashes = hashes[n:]
        match.num_revived = sum(self.pool.is_cached_free(b) for b in match.device_blocks())
        return match

    def _group_hits(self, seq: Sequence, hashes: list[int], n: int) -> tuple[int, list[list[int]]]:
        """The longest hit of at most `n` blocks that every other group can serve, and
        those groups' blocks. A miss at block i in what a group needs for a hit of n
        rules out every hit that needs i, so the candidate drops to i; each block is
        looked up at most once per group."""
        groups, bs = self.groups, self.block_size
        found: list[dict[int, int | None]] = [{} for _ in range(self.num_groups)]

        def hit(g: int, i: int) -> int | None:
            if i not in found[g]:
                found[g][i] = self.pool.lookup(group_key(hashes[i], g), self._tokens_of_block(seq, i))
            return found[g][i]

        settled = False
        while n and not settled:
            settled = True
            for g in range(1, self.num_groups):
                first = groups.first_block(g, n * bs, bs)
                miss = next((i for i in range(n - 1, first - 1, -1) if hit(g, i) is None), None)
                if miss is not None:
                    n, settled = miss, False
                    break
        ids = []
        for g in range(1, self.num_groups):
            first = groups.first_block(g, n * bs, bs)
            ids.append([NULL_BLOCK] * first + [found[g][i] for i in range(first, n)])
        return n, ids

    def _prefix_hashes(self, seq: Sequence, limit: int) -> list[int]:
        """The first `limit` full blocks' chained hashes, computed once per sequence: a
        request waiting for room is looked up every step, and its tokens only grow."""
        cache = seq.prefix_hashes
        if len(cache) < limit:
            parent = cache[-1] if cache else None
            cache += prefix_block_hashes(
                seq.token_ids, self.block_size, self.root(seq), len(cache), parent, limit - len(cache)
            )
        return cache[:limit]

    def root(self, seq: Sequence) -> int:
        """The parent of `seq`'s first block hash: the model's fingerprint root mixed with
        the request's `cache_salt`, so every tier (device cache, host RAM, disk, Redis)
        keeps differently salted prefixes apart."""
        if seq.hash_root is None:
            seq.hash_root = root_hash(self.fingerprint, seq.params.cache_salt)
        return seq.hash_root

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        """Blocks `num_new_tokens` more tokens take, all groups (a sliding group's share
        is capped at its window plus one chunk: what it frees as it goes comes back)."""
        have = max(len(seq.block_table), num_cached_blocks)
        base = max(seq.num_computed_tokens, num_cached_blocks * self.block_size)
        new = max(0, -(-(base + num_new_tokens) // self.block_size) - have)
        if self.num_groups == 1:
            return new
        return sum(min(new, cap) if cap else new for cap in self._window_cap)

    def can_admit(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int, reserve: int = 0) -> bool:
        """True if admission leaves at least `reserve` blocks free (headroom for decodes)."""
        need = self.blocks_needed(seq, num_new_tokens, len(match.block_ids))
        return need + reserve <= self.pool.num_free - match.num_revived

    def admit(self, seq: Sequence, match: PrefixMatch) -> None:
        """Take references on the matched blocks; they become the start of the tables."""
        for block_id in match.device_blocks():
            self.pool.acquire(block_id)
        seq.block_tables = [list(match.block_ids)] + [list(ids) for ids in match.group_ids]
        seq.block_tables += [[] for _ in range(self.num_groups - len(seq.block_tables))]
        seq.block_hashes = list(match.hashes)
        seq.num_computed_tokens = len(match.block_ids) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += len(seq)
            self.prefix_hits += seq.num_computed_tokens

    def pin(self, match: PrefixMatch) -> list[int]:
        """Take references on `match`'s blocks without admitting: a sequence that waits
        keeps its device prefix from eviction. Returns the blocks to `unpin`."""
        blocks = match.device_blocks()
        for block_id in blocks:
            self.pool.acquire(block_id)
        return blocks

    def unpin(self, blocks: list[int]) -> None:
        for block_id in blocks:
            self.pool.release(block_id)

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the tables to cover num_computed + num_new_tokens; all or nothing. Blocks
        that fell out of a sliding window are released first."""
        self.trim_window(seq)
        need = max(0, -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table))
        if need * self.num_groups > self.pool.num_free:
            return False
        for table in seq.block_tables:
            for _ in range(need):
                table.append(self.pool.allocate())
        return True

    def trim_window(self, seq: Sequence) -> int:
        """Release each sliding group's blocks wholly before its window (the next query
        is at num_computed_tokens). Returns how many were released."""
        if self.num_groups == 1 or not seq.block_table:
            return 0
        released = 0
        for g in range(1, self.num_groups):
            table = seq.block_tables[g]
            i = min(self.groups.first_block(g, seq.num_computed_tokens, self.block_size), len(table)) - 1
            while i >= 0 and table[i] != NULL_BLOCK:  # entries before a NULL are NULL too
                self.pool.release(table[i])
                table[i] = NULL_BLOCK
                released += 1
                i -= 1
        return released

    def free(self, seq: Sequence) -> None:
        """Release all of a sequence's blocks, tail first, so that on eviction the tail
        of a prefix goes before its head (the head is the likelier to be shared)."""
        tables = seq.block_tables
        for i in range(len(tables[0]) - 1, -1, -1):
            for table in reversed(tables):
                if table[i] != NULL_BLOCK:
                    self.pool.release(table[i])
        seq.block_tables = [[] for _ in range(self.num_groups)]
        seq.block_hashes = []

    def held_blocks(self, seq: Sequence) -> list[int]:
        """Every block the sequence holds, all groups."""
        return [b for table in seq.block_tables for b in table if b != NULL_BLOCK]

    def blocks_per_group(self, seq: Sequence) -> list[int]:
        """Blocks the sequence holds in each group."""
        return [sum(b != NULL_BLOCK for b in table) for table in seq.block_tables]

    def register_computed(self, seq: Sequence) -> None:
        """Publish the full blocks whose KV is now computed, then release what fell out
        of a sliding window (published first, so it stays in the prefix cache)."""
        if self.enable_prefix_caching:
            self._register(seq)
        self.trim_window(seq)

    def _register(self, seq: Sequence) -> None:
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[i - 1] if i else self.root(seq)
            tokens = self._tokens_of_block(seq, i)
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            self.pool.register(seq.block_table[i], h, tokens)
            for g in range(1, self.num_groups):
                block_id = seq.block_tables[g][i]
                if block_id != NULL_BLOCK:
                    self.pool.register(block_id, group_key(h, g), tokens)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
