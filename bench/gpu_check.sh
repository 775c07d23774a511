#!/usr/bin/env bash
# CUDA checks for the code paths that CPU tests cannot reach (< 5 minutes on one GPU):
#   1. device <-> pinned host block copies through the transfer worker (side stream,
#      event ordering, one transfer per pool tensor) move exact bytes, for a model-dtype
#      pool and an int8 pool with scales, on random and on adjacent block ids;
#   2. the same copies' throughput (bench/kv_block_copy.py, JSON), against the old
#      per-block strided copy in the same run.
# Usage: bash bench/gpu_check.sh   (uses .venv/bin/python unless PY is set)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" - <<'PYEOF'
import time
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA device visible to torch")
from tierguard.kv.copy_handlers import register_device_host
from tierguard.kv.media.host import HostTier
from tierguard.kv.media import DeviceBlocks, HostSlots
from tierguard.kv.spec import DevicePool, KVLayout
from tierguard.kv.transfer import TransferSpec, TransferWorker

def wait(worker, n):
    got = []
    deadline = time.monotonic() + 60
    while len(got) < n and time.monotonic() < deadline:
        got += worker.get_finished()
        time.sleep(0.001)
    assert len(got) == n and all(r.success for r in got), got
    return got

for layout in (KVLayout(32, 8, 128, 16, "bfloat16"), KVLayout(4, 2, 64, 16, "int8", "int8")):
    pool = DevicePool.allocate(layout, 256, "cuda")
    for t in pool.tensors:
        t.copy_(torch.randint(-100, 100, t.shape, device="cuda").to(t.dtype))
    host = HostTier(64 * pool.block_bytes, pool.block_bytes)
    assert host.pinned
    worker = TransferWorker(pool.block_bytes)
    register_device_host(worker, pool, host)
    src = [5, 6, 7, 100, 3, 200]  # a run, then lone blocks
    slots = [0, 1, 2, 10, 11, 40]
    before = [t.clone() for t in pool.tensors]
    # the copy must see writes queued on the caller's stream just before submit
    pool.tensors[0][5].zero_()
    before[0][5].zero_()
    worker.transfer_async(1, TransferSpec(DeviceBlocks(src), HostSlots(slots)))
    wait(worker, 1)
    dst = [50, 51, 52, 60, 61, 62]
    worker.transfer_async(2, TransferSpec(HostSlots(slots), DeviceBlocks(dst)))
    wait(worker, 1)
    torch.cuda.synchronize()
    for t, old in zip(pool.tensors, before):
        for s, d in zip(src, dst):
            assert torch.equal(t[d].view(torch.uint8), old[s].view(torch.uint8)), (layout, s, d)
        assert torch.equal(t[0], old[0])
    worker.shutdown()
    print(f"gpu_check: exact round trip ok for {layout.dtype}/{layout.quantization}, block {pool.block_bytes} B")
PYEOF
"$PY" bench/kv_block_copy.py --device cuda --layers 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --jobs 100 --pool-blocks 2048
# 3. decode steps captured as CUDA graphs give the same tokens and logits as
#    eager steps (padding rows write only the scratch block); int8/int4 weights on CUDA
#    (the blocked plain-torch matmul) generate; decode speed with and without graphs.
"$PY" - <<'PYEOF'
import torch
from tierguard.engine.api import SamplingParams
from tierguard.engine.factory import build_engine
from tierguard.model.tiny import ensure_tiny_model

d = ensure_tiny_model()
prompts = [[(7 * i + j) % 4000 + 5 for i in range(20 + 13 * j)] for j in range(5)]
runs = {}
for graphs in (False, True):
    e = build_engine(d, device="cuda", dtype="float32", kv_cache_gib=0.05, max_model_len=512, cuda_graphs=graphs)
    seen = []
    e.logits_hook = lambda ids, lg: seen.append(lg.float().cpu())
    out = e.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    g = e.runner.decode_graphs
    runs[graphs] = (out, seen, g.num_captured if g else 0, g.num_replays if g else 0)
    e.check_integrity()
(a, la, _, _), (b, lb, cap, rep) = runs[False], runs[True]
assert cap > 0 and rep > 0, (cap, rep)
assert a == b, "greedy tokens differ with CUDA graphs"
err = max(float((x - y).abs().max()) for x, y in zip(la, lb))
assert err < 1e-3, err
print(f"gpu_check: CUDA graphs: {cap} captured, {rep} replays, same tokens, max |dlogit| {err:.2e}")
for wd in ("int8", "int4"):
    e = build_engine(d, device="cuda", dtype="float32", kv_cache_gib=0.05, max_model_len=512, weight_dtype=wd)
    out = e.generate(prompts[:2], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert all(len(o) == 16 for o in out)
    print(f"gpu_check: {wd} weights on CUDA: {e.runner.weight_bytes} bytes, generates")
PYEOF
for g in 1 0; do
  "$PY" - "$g" <<'PYEOF'
import json, sys, time
from tierguard.engine.api import SamplingParams
from tierguard.engine.factory import build_engine
from tierguard.model.tiny import ensure_tiny_model
from tierguard.engine.speed import measure
e = build_engine(ensure_tiny_model(), device="cuda", dtype="float32", kv_cache_gib=0.5, max_model_len=512,
                 max_num_seqs=32, cuda_graphs=sys.argv[1] == "1")
for b in (1, 8, 32):
    r = measure(e, b, 128, 64, 0.0)
    print(json.dumps({"cuda_graphs": sys.argv[1] == "1", "batch": b, "ms_per_step": r["ms_per_step"],
                      "tokens_per_s": r["tokens_per_s"]}))
PYEOF
done
