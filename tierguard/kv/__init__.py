"""Tiered KV store and the cold contract.

Tiers: device pool (hot KV of running sequences only) -> host RAM (`HostTier`, a bounded
slab, LRU) -> NVMe (`DiskTier`, one checksummed file per block). Policy (`OffloadManager`,
`ColdContract`) is kept apart from mechanism (`TransferWorker`); `KVTierStore` chains them
for the engine.

The contract, answering R4's questions:

- What goes to disk: only full prefix blocks worth reusing (shared system prompts,
  documents, the turns of a saved session) - the engine offloads them with
  `persist=True`. State of preempted running sequences goes to host RAM only. Keys are
  (fingerprint, chained block hash); the fingerprint covers model, dtype, quantization,
  block size and layout, so another model never reads these blocks.
- When it is cold: anything on disk is cold. It is read only as staging when a stage of
  work begins (admission, or a new turn of a saved session), by the transfer worker's
  threads, with a deadline derived from the request class's TTFT budget. It is never
  read on the decode path: the engine wraps each decode step in `decode_guard()`, and a
  disk read from inside it raises `ColdContractViolation`. If staging misses its
  deadline, an interactive request recomputes the prefix (or goes async when recompute
  is hopeless); a batch request keeps waiting. Each decision is counted and logged.
- Who cleans files: the disk tier alone, in its own `<dir>/<fingerprint>/`. It removes
  least-recently-used blocks to stay within `--kv-disk-gib`, deletes a block whose
  checksum fails, and at start-up removes temporary files of dead writers and files with
  torn headers. It never touches files of other fingerprints or files it did not name.
- Disk full / I/O error / bad checksum: a miss, recomputed; never an exception to the
  request. ENOSPC, a read-only directory or repeated write errors disable disk writes,
  `healthy` turns False with a reason (for /health and /metrics), and serving goes on with
  host RAM and recompute.
- Restart: writes are atomic (temp file, fdatasync, rename, directory fsync), so after a
  crash or kill -9 every block file is whole or absent; the index is rebuilt by scanning
  the directory, so saved prefixes are served from disk after a restart. Host RAM starts
  empty.
"""
