"""Layer groups of the KV pool: which layers share a block table, and how much each keeps.

A model whose layers all attend to the whole context has one group holding every layer:
a block spans all layers, a sequence has one block table. A model with sliding-window
layers (Gemma 3: five local layers to one global) splits its layers into groups of one
kind and equal width, as vLLM's hybrid allocator does:

    group 0 .. F-1   full attention      (the block table grows with the context)
    group F .. G-1   sliding window W    (blocks wholly before the window are freed)

Every group's block is the same number of bytes (`width` layers), so all groups draw from
one pool and a freed sliding block can serve any group. Layer `l` lives in slot
`slot_of[l]` of its group's blocks: the pool tensor is [blocks, width, 2, block_size,
kv_heads, head_dim] and layer l reads `kv[:, slot_of[l]]` through its group's table.

Window arithmetic (one convention for the engine, the tiers and `plan`): a query at
position p sees keys p - W + 1 ..= p. Once a sequence has computed n tokens, the next
query is at n, so a sliding group needs positions from `first_needed(n) = max(0, n - W + 1)`
on; blocks wholly before that are freed. During a step that computes `chunk` tokens a
sliding group holds at most ceil((W - 1 + chunk) / block_size) + 1 blocks, which is
`plan`'s per-sequence figure for a sliding layer (tierguard/plan/kv.py).

Prefix caching keys a group's block by `group_key(hash, g)`: group 0 uses the block's
chained hash as it is (a single-group pool keys blocks exactly as before groups
existed); other groups derive their key from it, so the device prefix cache and the
tiers hold each group's copy of a position apart without knowing about groups.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import reduce

from tierguard.common.errors import TierguardError

NULL_BLOCK = -1  # a table entry whose block was freed (outside a sliding window)


def group_key(block_hash: int, group: int) -> int:
    """The prefix-cache and tier key of group `group`'s copy of a block."""
    if group == 0:
        return block_hash
    # SHA-256 as the chain itself (tierguard/engine/prefix_hash.py): a group's key is as
    # hard to collide as a block hash.
    data = b"tierguard kv group\x00" + block_hash.to_bytes(32, "little") + group.to_bytes(4, "little")
    return int.from_bytes(hashlib.sha256(data).digest(), "little")


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]  # model layer indices, in slot order
    window: int | None = None  # None: full attention; else the sliding window in tokens

    @property
    def sliding(self) -> bool:
        return self.window is not None


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]

    @classmethod
    def single(cls, num_layers: int) -> KVGroups:
        """Every layer full attention: one group, a block spans all layers."""
        return cls((KVGroup(tuple(range(num_layers))),))

    @classmethod
    def from_layer_windows(cls, windows: list[int | None]) -> KVGroups:
        """Groups for per-layer windows (None: full attention). The width is the gcd of
        the per-kind layer counts, so every group is full and of one kind; full groups
        come first (group 0 is always full attention)."""
        kinds: dict[int | None, list[int]] = {}
        for layer, w in enumerate(windows):
            kinds.setdefault(w, []).append(layer)
        if None not in kinds:
            raise TierguardError("a model whose every layer slides needs no layer groups: it has no full layer")
        if len(kinds) == 1:
            return cls.single(len(windows))
        width = reduce(math.gcd, (len(v) for v in kinds.values()))
        order = [None] + sorted(w for w in kinds if w is not None)
        groups = []
        for w in order:
            layers = kinds[w]
            groups += [KVGroup(tuple(layers[i : i + width]), w) for i in range(0, len(layers), width)]
        return cls(tuple(groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def width(self) -> int:
        """Layers per block (the pool tensor's second dimension)."""
        return len(self.groups[0].layers)

    @property
    def num_layers(self) -> int:
        return self.width * self.num_groups

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    def placement(self) -> list[tuple[int, int]]:
        """(group, slot) of every model layer, by layer index."""
        out: list[tuple[int, int]] = [(0, 0)] * self.num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                out[layer] = (g, slot)
        return out

    def describe(self) -> list[dict]:
        """For the fingerprint and logs: each group's layers and window."""
        return [{"layers": list(g.layers), "window": g.window} for g in self.groups]

    # -- window arithmetic --------------------------------------------------------------
    def first_needed(self, g: int, num_computed: int) -> int:
        """First token position group `g` still needs once `num_computed` tokens are in."""
        w = self.groups[g].window
        return 0 if w is None else max(0, num_computed - w + 1)

    def first_block(self, g: int, num_computed: int, block_size: int) -> int:
        """Index of the first block group `g` keeps once `num_computed` tokens are in."""
        return self.first_needed(g, num_computed) // block_size

    def group_blocks(self, g: int, context: int, chunk: int, block_size: int) -> int:
        """Most blocks group `g` holds for one sequence of `context` tokens computed in
        steps of at most `chunk` tokens (a step holds the window before it plus the chunk)."""
        full = -(-context // block_size)
        w = self.groups[g].window
        if w is None:
            return full
        return min(full, -(-min(w - 1 + chunk, context) // block_size) + 1)

    def sequence_blocks(self, context: int, chunk: int, block_size: int) -> int:
        """Most blocks one sequence of `context` tokens holds, all groups together."""
        return sum(self.group_blocks(g, context, chunk, block_size) for g in range(self.num_groups))
