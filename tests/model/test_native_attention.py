"""The CPU decode kernel (tierguard/model/native.py) equals the torch path it replaces.

The kernel picks its work split by the OpenMP thread count (a unit per sequence when there
are at least as many sequences as threads, else a unit per KV head), so every case pins
torch's thread count (the kernel shares torch's OpenMP runtime) and both splits are run
whatever the machine's core count."""

from __future__ import annotations

import pytest
import torch

from tests.needs import skip_without_kernels
from tierguard.model import native
from tierguard.model.attention import AttentionMetadata, paged_attention

pytestmark = skip_without_kernels()


def _torch_decode(q, k, v, layer, tables, ctx, bs):
    """The gather + SDPA path on a copy of the pool: (output, pool after the write)."""
    layer = layer.clone()
    b = q.shape[0]
    nb = -(-int(ctx.max()) // bs)
    tl = tables[:, :nb].long()
    last = ctx.long() - 1
    slots = tl.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs
    mask = (torch.arange(nb * bs).unsqueeze(0) < ctx.long().unsqueeze(1)).view(b, 1, 1, -1)
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=b, decode_blocks=tl, decode_mask=mask)
    return paged_attention(q, k, v, layer, meta), layer


def _check_kernel(heads, kv_heads, head_dim, bs, ctx_list, rows_list):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim + len(ctx_list))
    num_blocks, batch = 64, len(ctx_list)
    pool = torch.randn(num_blocks, 3, 2, bs, kv_heads, head_dim, generator=gen)
    layer = pool[:, 1]  # a middle layer's strided view, as the model passes it
    ctx = torch.tensor(ctx_list, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(max(rows_list) + 2, 8, dtype=torch.int32)
    rows = torch.tensor(rows_list, dtype=torch.int32)
    for i, r in enumerate(rows.tolist()):
        tables[r] = perm[i * 8 : (i + 1) * 8].to(torch.int32)
    # q/k/v as the model hands them: views of one [B, H + 2 KV, D] projection
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim, generator=gen)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    ref, ref_pool = _torch_decode(q, k, v, layer, tables[rows.long()], ctx, bs)
    mine_pool = pool.clone()
    call = native.DecodeCall(tables, rows, ctx, int(ctx.max()), heads, kv_heads, head_dim, bs)
    out = call.run(q, k, v, mine_pool[:, 1])
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5), (out - ref).abs().max()
    assert torch.equal(mine_pool[:, 1], ref_pool)  # the new K/V landed in the same slots
    assert torch.equal(mine_pool[:, 0], pool[:, 0]) and torch.equal(mine_pool[:, 2], pool[:, 2])


@pytest.fixture
def threads(request):
    """torch's (and so the kernel's) OpenMP thread count, pinned for one test."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize(
    "threads", [1, 5, 8], indirect=True, ids=["per-sequence-1", "per-sequence-5", "per-head-8"]
)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,bs",
    [(9, 3, 64, 16), (8, 8, 32, 4), (8, 2, 36, 8), (4, 1, 128, 16)],  # GQA, MHA, odd dim, MQA
)
def test_kernel_matches_torch_path(heads, kv_heads, head_dim, bs, threads):
    """Five sequences: a unit per sequence (slot-major) on up to five threads, a unit per
    (sequence, KV head) on more."""
    _check_kernel(heads, kv_heads, head_dim, bs, [1, bs, bs + 1, 3 * bs - 2, 5 * bs], [3, 0, 6, 1, 4])


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,bs",
    # GQA; 4 query heads per KV head, 40 dims (not a multiple of 32); 12 query heads per
    # KV head (more than one pass of TG_PV_HEADS); odd dim (scalar loops); MHA
    [(9, 3, 64, 16), (8, 2, 40, 16), (12, 1, 64, 8), (8, 2, 36, 8), (8, 8, 32, 4)],
)
@pytest.mark.parametrize("ctx", [1, 3, 7 * 4 + 3])
@pytest.mark.parametrize("threads", [2, 1], indirect=True, ids=["per-head-2", "per-sequence-1"])
def test_one_sequence_split_by_kv_head_matches_torch_path(heads, kv_heads, head_dim, bs, ctx, threads):
    """One sequence: on two threads a unit per KV head (the batch-1 decode's path on more
    than one core), on one thread the whole sequence; contexts that end inside a
    four-slot group and inside a block."""
    _check_kernel(heads, kv_heads, head_dim, bs, [ctx], [2])


def test_supports_only_float32_cpu_pools():
    pool = torch.zeros(4, 2, 2, 16, 2, 64)
    assert native.supports(pool[:, 0], torch.float32, 8, 2)
    assert not native.supports(pool[:, 0].to(torch.bfloat16), torch.bfloat16, 8, 2)
    assert not native.supports(pool[:, 0], torch.bfloat16, 8, 2)


def test_loading_the_kernel_keeps_subnormal_floats():
    """Built with -ffast-math but not linked with it: loading must not switch the
    process to flush-to-zero (crtfastmath.o would, breaking e.g. hypothesis and numpy)."""
    native.library()
    tiny = float.fromhex("0x1p-1070")  # subnormal double
    assert tiny * 0.5 > 0.0
    assert torch.tensor(1e-42, dtype=torch.float32).item() > 0  # subnormal float32 survives
