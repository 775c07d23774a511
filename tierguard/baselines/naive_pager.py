"""`--kv-naive-sync-disk`: NVMe used as an extension of VRAM (benchmark only).

This is the failure mode the cold contract exists to prevent, built so it can be
measured side by side; naive_scheduler.py drives it. When the device pool runs short,
the scheduler does not stop admitting and does not preempt: it *pages out* the newest
running sequence, writing all of its blocks to disk on the engine thread, and the
sequence stays in the running set. When its turn comes in a later step, its blocks are read back
synchronously inside that step (paging out someone else if needed) before the model
runs. With a working set larger than the pool, every step writes and reads blocks on
the decode path; each such read is counted by the disk tier (`reads_in_decode`) and
the time the engine thread spent blocked is counted here. Spilled blocks are dropped
from the page cache right after they are written (see tierguard/baselines/naive_kv.py), so the
read-back waits for the device, as it would with NVMe used as VRAM on a real server.

A paged-out sequence holds no device blocks and keeps `num_computed_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from tierguard.baselines.naive_kv import NaiveSyncDisk
from tierguard.common.stats import counter, gauge
from tierguard.engine.block_pool import BlockPool
from tierguard.engine.sequence import Sequence


@dataclass
class PagerCounters:
    page_outs: int = 0
    page_ins: int = 0
    failed_page_ins: int = 0


@dataclass
class NaivePagerStats:
    """Exported with the prefix `kv_naive_`."""

    page_outs: int = counter("Running sequences paged out to disk (naive mode).", "naive_page_outs")
    page_ins: int = counter("Paged-out sequences read back inside a step.", "naive_page_ins")
    failed_page_ins: int = counter("Page-ins that lost a block (recomputed).", "naive_failed_page_ins")
    paged_out_seqs: int = gauge("Sequences paged out now.", "naive_paged_out_seqs")
    spills: int = counter("Blocks written synchronously by the engine thread.", "naive_spills")
    sync_reads: int = counter("Blocks read synchronously by the engine thread.", "naive_sync_reads")
    stall_ms: float = counter("Engine-thread time blocked on naive disk I/O, ms.", "naive_stall_ms")
    uncached_spills: int = counter("Spilled blocks dropped from the page cache.", "naive_uncached_spills")
    reads_in_decode: int = counter("Disk reads done inside a decode step.", "naive_reads_in_decode")


def _tail_key(seq: Sequence, index: int) -> int:
    """Disk key of a block with no prefix hash yet (the partial tail). It names the
    computed length too: the disk tier treats an existing key as the same bytes."""
    return xxhash.xxh3_64_intdigest(f"naive-tail:{seq.seq_id}:{index}:{seq.num_computed_tokens}".encode())


class NaivePager:
    def __init__(self, pool: BlockPool, disk: NaiveSyncDisk, block_size: int) -> None:
        self.pool = pool
        self.disk = disk
        self.block_size = block_size
        self.paged: dict[str, list[int]] = {}  # seq id -> disk keys of its blocks, in order
        self.counters = PagerCounters()

    def is_paged_out(self, seq: Sequence) -> bool:
        return seq.seq_id in self.paged

    def blocks_needed(self, seq: Sequence) -> int:
        return len(self.paged.get(seq.seq_id, ()))

    def page_out(self, seq: Sequence) -> bool:
        """Write every block of `seq` to disk now and release them; False (nothing changed)
        if the disk refused a block."""
        keys = [
            seq.block_hashes[i] if i < len(seq.block_hashes) else _tail_key(seq, i)
            for i in range(len(seq.block_table))
        ]
        for key, block in zip(keys, seq.block_table, strict=True):
            if not self.disk.spill(key, block):
                return False
        for block in reversed(seq.block_table):
            self.pool.release(block)
            self.pool.drop_cached(block)  # the device copy is gone: that is why it paged out
        seq.block_table = []
        self.paged[seq.seq_id] = keys
        self.counters.page_outs += 1
        return True

    def page_in(self, seq: Sequence) -> bool | None:
        """Read a paged-out sequence back (synchronously). None: not enough free blocks now;
        False: a block was lost (the caller recomputes the sequence); True: resident again."""
        keys = self.paged.get(seq.seq_id)
        if keys is None:
            return True
        if self.pool.num_free < len(keys):
            return None
        blocks: list[int] = []
        bs = self.block_size
        for i, key in enumerate(keys):
            block = self.pool.allocate()
            blocks.append(block)
            if not self.disk.restore(key, block):
                for b in reversed(blocks):
                    self.pool.release(b)
                del self.paged[seq.seq_id]
                self.counters.failed_page_ins += 1
                return False
            if i < len(seq.block_hashes):
                self.pool.register(block, key, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
        seq.block_table = blocks
        del self.paged[seq.seq_id]
        self.counters.page_ins += 1
        return True

    def forget(self, seq: Sequence) -> None:
        self.paged.pop(seq.seq_id, None)

    def stats(self) -> NaivePagerStats:
        n = self.disk.counters
        return NaivePagerStats(
            page_outs=self.counters.page_outs,
            page_ins=self.counters.page_ins,
            failed_page_ins=self.counters.failed_page_ins,
            paged_out_seqs=len(self.paged),
            spills=n.spills,
            sync_reads=n.restores,
            stall_ms=1000 * n.stall_s,
            # Spilled blocks whose page-cache copy was dropped: their reads wait for the device.
            uncached_spills=n.dropped,
            reads_in_decode=self.disk.disk.stats().reads_in_decode,
        )
