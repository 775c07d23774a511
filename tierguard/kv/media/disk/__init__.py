"""The "disk" medium (NVMe): one checksummed file per block under `<dir>/<fingerprint>/`.

tier.py      DiskTier: atomic writes, byte budget, LRU, restart scan, the decode guard
format.py    block file names, directory scan, raw file I/O
upkeep.py    the sweeper thread: TTL expiry, resealing blocks of an old key
recovery.py  writes suspended on disk full or errors, resumed after a probe succeeds
old_dirs.py  old fingerprints' directories: counted in the budget, removed oldest first
owner.py     ownership by flock (the directory's lock, the vLLM slab), bounded pid parsing
purge.py     `tierguard kv purge`: operators remove block files (by age, by fingerprint)
"""
