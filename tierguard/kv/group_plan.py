"""Which tier keys a sequence's blocks go out under and come back from, per layer group.

The tiers store blocks by key and know nothing of layer groups (tierguard/kv/groups.py):
group g's block at position i is keyed `group_key(hash_i, g)` (group 0: the hash itself,
so a single-group pool's keys are its block hashes, as they always were).

- Out (`offload_pairs`): every block the sequence holds, all groups; a sliding group
  holds only its window, so only the window goes out.
- Back (`load_keys`): a hit of n blocks needs every full group's blocks 0..n-1 and each
  sliding group's blocks from its window's first block (for a query at n * block_size)
  to n - 1. Blocks the device already matched are not loaded again; the rest must all
  be in some tier, else the hit shrinks to what can be served whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tierguard.kv.groups import NULL_BLOCK, KVGroups, group_key


class _Seq(Protocol):
    block_tables: list[list[int]]
    block_hashes: list[int]


class _Match(Protocol):
    block_ids: list[int]
    hashes: list[int]
    missed_hashes: list[int]
    group_ids: list[list[int]]


def offload_pairs(groups: KVGroups, seq: _Seq) -> tuple[list[int], list[int]]:
    """(keys, device blocks) of the sequence's hashed blocks, all groups, in order."""
    n = min(len(seq.block_hashes), len(seq.block_tables[0]))
    keys, blocks = list(seq.block_hashes[:n]), list(seq.block_tables[0][:n])
    for g in range(1, groups.num_groups):
        for i, b in enumerate(seq.block_tables[g][:n]):
            if b != NULL_BLOCK:
                keys.append(group_key(seq.block_hashes[i], g))
                blocks.append(b)
    return keys, blocks


def match_keys(groups: KVGroups, match: _Match) -> list[int]:
    """Keys of a device match's blocks, all groups."""
    keys = list(match.hashes)
    for g, ids in enumerate(match.group_ids, start=1):
        keys += [group_key(match.hashes[i], g) for i, b in enumerate(ids) if b != NULL_BLOCK]
    return keys


def load_keys(
    groups: KVGroups, available: Callable[[list[int]], int], match: _Match, block_size: int
) -> tuple[int, list[int], list[int]]:
    """(extra blocks k, keys to load, their positions): the longest extension of the
    device match by k blocks whose every needed key `available` (leading count in
    some tier) reports; group 0's keys first, in order."""
    missed = match.missed_hashes
    first_pos = len(match.block_ids)
    k = available(missed)
    while k > 0:
        n = first_pos + k
        keys, positions = list(missed[:k]), list(range(first_pos, n))
        shortfall = None
        for g in range(1, groups.num_groups):
            start = max(groups.first_block(g, n * block_size, block_size), first_pos)
            wanted = [group_key(missed[i - first_pos], g) for i in range(start, n)]
            have = available(wanted)
            if have < len(wanted):
                shortfall = start + have  # every hit that needs this position fails
                break
            keys += wanted
            positions += range(start, n)
        if shortfall is None:
            return k, keys, positions
        k = shortfall - first_pos
    return 0, [], []
