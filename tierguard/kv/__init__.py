"""Tiered KV store and the cold contract.

Tiers: device pool (hot KV of running sequences only) -> host RAM (`HostTier`, a bounded
slab) -> cold media (`DiskTier`, one checksummed file per block; `RemoteTier`, Redis shared
by replicas; more by registration).
The engine talks only to the connector; policy (manager, LRU, contract) is kept apart
from mechanism (transfer worker, copy handlers, media). See docs/architecture.md.

connector.py      the engine's one object: get_num_matched / start_load / offload / poll / abort
tiered_connector.py  the connector over host RAM and the cold media
contract.py       the cold contract: classes, TTFT budgets, staging deadlines, class order, decisions
manager.py        KVManager (lookup / prepare_load / complete_load / prepare_store / ... / touch)
lru.py            eviction policy, apart from the storage it protects
transfer.py       transfer worker: jobs routed by (source spec, destination spec) to handlers
copy_handlers.py  device <-> host (batched, contiguous) and host <-> cold medium handlers
spec.py           KV layout (blocks first), device pool, the one model fingerprint
groups.py         layer groups of the pool (full / sliding window) and the window arithmetic
group_plan.py     which tier keys each group's blocks go out under and come back from
guard.py          the decode guard: a disk read inside a decode step raises ColdContractViolation
faults.py         fault injection for tests (errors and delays at real I/O points)
quant.py          fp8 / int8 KV quantization and its error
media/            where blocks live: the ColdMedium interface and registry, the block format,
                  the host-RAM slab (media/host.py), media/disk/ (NVMe), media/remote/ (Redis)

The contract, answering R4's questions:

- What goes to disk: only full prefix blocks worth reusing (shared system prompts,
  documents, the turns of a saved session): the blocks of a finished sequence, written
  behind the answer. State of preempted running sequences goes to host RAM only. Keys are
  (fingerprint, chained block hash); the fingerprint covers model, dtype, quantization,
  block size and layout, so another model never reads these blocks.
- When it is cold: anything on disk is cold. It is read only as staging when a stage of
  work begins (admission, or a new turn of a saved session), by the transfer worker's
  threads, with a deadline derived from the request class's TTFT budget. It is never
  read on the decode path: the engine wraps each decode step in `decode_guard()`, and a
  disk read from inside it raises `ColdContractViolation`. If staging misses its
  deadline, an interactive request recomputes the prefix (or goes async when recompute
  is hopeless); a batch request keeps waiting. Each decision is counted and logged.
- Who cleans files: the disk tier, in its own `<dir>/<fingerprint>/`, and operators with
  `tierguard kv purge`. The tier removes least-recently-used blocks to stay within
  `--kv-disk-gib`, blocks unused for `--kv-disk-ttl-s` (its sweeper thread), a block whose
  checksum fails, and at start-up temporary files of dead writers, files with torn
  headers and (encryption on) unencrypted blocks. Neither touches files of other
  fingerprints or files the tier did not name.
- At rest: with `--kv-encrypt-key-file` blocks are sealed with AES-256-GCM (fingerprint
  and hash as associated data); a wrong or missing key is a miss, never an error, and
  never overwrites the right key's blocks; `--kv-encrypt-old-key-file` rotates.
- Disk full / I/O error / bad checksum: a miss, recomputed; never an exception to the
  request. ENOSPC, a read-only directory or repeated write errors disable disk writes,
  `healthy` turns False with a reason (for /health and /metrics), and serving goes on with
  host RAM and recompute.
- Restart: writes are atomic (temp file, fdatasync, rename, directory fsync), so after a
  crash or kill -9 every block file is whole or absent; the index is rebuilt by scanning
  the directory, so saved prefixes are served from disk after a restart. Host RAM starts
  empty.
"""
