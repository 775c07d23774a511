"""Baselines for benchmarks, never production paths.

The article's failure mode, built so that it can be measured against the cold contract:
`--kv-naive-sync-disk` pages running sequences out to NVMe and reads them back
synchronously inside decode. Only the switch that builds an engine for that flag
(`LLMEngine`) and the benches import this package.

naive_scheduler.py  demand-paging scheduler: a disk read inside the decode step
naive_pager.py      pages running sequences out to disk and back for naive_scheduler
naive_kv.py         synchronous spill/restore of blocks to files
"""
