"""tierguard's inference engine, in the spirit of nano-vllm (one job per module).

api.py           the contract with front ends (SamplingParams, RequestOutput, AsyncEngine)
config.py        EngineConfig
sequence.py      per-request state
prefix_hash.py   chained content hashes of full KV blocks (+ model/dtype fingerprint)
block_pool.py    physical blocks: free / cached (LRU) / used, ref counts, on_evict hook
block_manager.py block tables and prefix caching on top of the pool
scheduler.py     continuous batching, chunked prefill, preemption by recompute
model_runner.py  schedule -> tensors (slots, block tables, positions) -> model; owns kv_cache
sampler.py       greedy / temperature / top-k / top-p / seeds, batched
detokenizer.py   incremental detokenization and stop strings
llm_engine.py    sync engine: add_request / step / abort, stats, step listeners
async_engine.py  AsyncLLMEngine: engine thread + asyncio delivery
factory.py       build an engine from a model directory and a memory budget
speed.py         `python -m tierguard.engine.speed`: decode tokens/s probe
"""
