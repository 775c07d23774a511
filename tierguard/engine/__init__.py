"""tierguard's inference engine, in the spirit of nano-vllm (one job per module).

Request path: api -> llm_engine.step(): connector.poll -> scheduler.schedule ->
model_runner.run -> sampler -> detokenizer; tiers are reached only through the KV
connector (tierguard/kv/connector.py). See docs/architecture.md.

api.py              the contract with front ends (SamplingParams, RequestOutput, EngineStats, AsyncEngine)
config.py           EngineConfig, validated at construction
sequence.py         per-request state (token ids, block table, counters), a step's schedule
prefix_hash.py      chained content hashes of full KV blocks, salted by the model fingerprint
block_pool.py       physical blocks: free / cached (LRU) / used, ref counts, eviction record
block_manager.py    block tables and prefix caching on top of the pool
scheduler.py        continuous batching, chunked prefill, preemption by recompute; connector hooks
admission.py        admission policies: FIFO, or the cold contract's class order with tiers
step_budget.py      prefill tokens per step and whether the batch may grow (--target-itl-ms, --itl-slo-ms)
slo_waves.py        under --itl-slo-ms: new sequences start decoding together, catch-up steps
model_runner.py     schedule -> tensors (slots, block tables, positions) -> model; owns the KV pool
group_metadata.py   per-layer-group attention metadata (sliding-window groups read only their window)
sampler.py          greedy / temperature / top-k / top-p / seeds, batched
detokenizer.py      incremental detokenization and stop strings
llm_engine.py       sync engine: add_request / step / abort, stats, step listeners; builds the connector
async_engine.py     AsyncLLMEngine: engine thread + asyncio delivery
factory.py          build an engine from a model directory and a memory budget
weight_offload.py   decoder layers kept in host memory and streamed in per step (its own budget)
kv_quality.py       greedy agreement and attention error of a quantized KV pool vs the model dtype
speed.py            `python -m tierguard.engine.speed`: decode tokens/s probe

The benchmark-only baseline (`--kv-naive-sync-disk`) lives in tierguard/baselines/.
"""
