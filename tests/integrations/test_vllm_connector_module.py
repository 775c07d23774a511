"""`TierguardConnector` itself (connector.py), imported and driven the way vLLM drives it,
without vLLM: vLLM's base class and enums are stand-ins (vllm_stub.py), everything else
is real (both roles' objects, the scheduler and worker sides, a disk tier, the shared
slab). What connector.py must do is translate: requests into hashes and classes, the
scheduler's step into metadata the worker reads, the worker's report back, and a failed
copy into `get_block_ids_with_load_errors`. The same hooks inside a real vLLM are
test_vllm_real.py (slow)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from tests.integrations import vllm_stub
from tests.integrations.harness import BLOCK, HEAD, HEADS, LAYERS, NUM_BLOCKS

TOKENS = list(range(2000, 2000 + 6 * BLOCK + 1))  # six full blocks and one more token
PAGE = HEADS * BLOCK * 2 * HEAD * 2  # one block of one layer, bfloat16


@pytest.fixture
def connector(monkeypatch):
    yield vllm_stub.install(monkeypatch)
    vllm_stub.uninstall()


def vllm_config(tmp_path, world_size: int = 1, **extra) -> SimpleNamespace:
    opts = {"kv_host_gib": 0.001, "host_shm_dir": str(tmp_path / "shm"), "kv_disk_dir": str(tmp_path / "kv"),
            "kv_disk_gib": 0.01, **extra}
    model = tmp_path / "model"  # the fingerprint hashes the checkpoint's weight files
    model.mkdir(exist_ok=True)
    (model / "model.safetensors").write_bytes(b"weights of a tiny model")
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=opts, engine_id="e0"),
        load_config=SimpleNamespace(download_dir=None),
        parallel_config=SimpleNamespace(world_size=world_size),
        cache_config=SimpleNamespace(kv_cache_layout=None),
        model_config=SimpleNamespace(model=str(model), served_model_name="tiny", dtype="float32",
                                     hf_text_config=SimpleNamespace(to_dict=lambda: {"num_hidden_layers": 2})),
    )


def kv_cache_config(sliding_window: int | None = None) -> SimpleNamespace:
    spec = vllm_stub.AttentionSpec(BLOCK, HEADS, HEAD, torch.bfloat16, PAGE, sliding_window)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(LAYERS))],
                           kv_cache_tensors=[SimpleNamespace(layers=[n]) for n in LAYERS])


def request(req_id: str, tokens: list[int], **kw) -> SimpleNamespace:
    base = dict(request_id=req_id, lora_request=None, mm_features=None, prompt_embeds=None, cache_salt=None,
                kv_transfer_params=None, priority=0, all_token_ids=tokens, num_tokens=len(tokens),
                num_computed_tokens=len(tokens))
    return SimpleNamespace(**{**base, **kw})


class Pair:
    """A scheduler-role and a worker-role connector over one fake KV cache, stepped in
    vLLM's order: build metadata, bind it, start loads, collect what finished, feed back."""

    def __init__(self, connector, cfg, kv_cfg) -> None:
        role = vllm_stub.KVConnectorRole
        self.sched = connector.TierguardConnector(cfg, role.SCHEDULER, kv_cfg)
        self.worker = connector.TierguardConnector(cfg, role.WORKER, kv_cfg)
        self.kv = {n: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16) for n in LAYERS}
        self.worker.register_kv_caches(self.kv)
        self.finished: set[str] = set()

    def step(self) -> tuple[set[str], set[str], set[int]]:
        meta = self.sched.build_connector_meta(SimpleNamespace())
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(SimpleNamespace())
        sent, recved = self.worker.get_finished(self.finished)
        self.finished = set()
        errors = self.worker.get_block_ids_with_load_errors()
        out = SimpleNamespace(finished_sending=sent, finished_recving=recved,
                              kv_connector_worker_meta=self.worker.build_connector_worker_meta())
        self.sched.update_connector_output(out)
        self.worker.clear_connector_metadata()
        return sent or set(), recved or set(), errors

    def until(self, pred, hang_guard_s: float = 30.0):
        end = time.monotonic() + hang_guard_s
        while True:
            got = self.step()
            if pred(got):
                return got
            assert time.monotonic() < end, "the connector never got there"
            time.sleep(0.002)

    def blocks(self, ids: list[int]) -> list[torch.Tensor]:
        return [t[b].clone() for t in self.kv.values() for b in ids]

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def test_a_finished_request_is_stored_and_the_next_one_loads_it_through_the_hooks(tmp_path, connector):
    pair = Pair(connector, vllm_config(tmp_path), kv_cache_config())
    try:
        first = request("a", TOKENS)
        assert pair.sched.get_num_new_matched_tokens(first, 0) == (0, False)  # nothing stored yet
        written = list(range(6))
        g = torch.Generator().manual_seed(3)
        for t in pair.kv.values():
            t[written] = torch.randn(t[written].shape, generator=g).to(t.dtype)
        delay, params = pair.sched.request_finished(first, written)
        assert delay is True and params is None  # vLLM keeps the blocks until the copy ends
        assert pair.sched.has_pending_push_work()
        pair.finished.add("a")
        pair.until(lambda got: "a" in got[0])
        pair.until(lambda _: not pair.sched.scheduler._jobs)  # written behind to disk

        second = request("b", TOKENS, num_computed_tokens=0)
        # the last prompt token is computed by vLLM itself: six blocks of four tokens match
        assert pair.sched.get_num_new_matched_tokens(second, 0) == (6 * BLOCK, True)
        targets = list(range(20, 26))
        alloc = SimpleNamespace(get_block_ids=lambda: (targets,))
        pair.sched.update_state_after_alloc(second, alloc, 6 * BLOCK)
        _, recved, errors = pair.until(lambda got: "b" in got[1])
        assert errors == set()
        assert all(torch.equal(x, y) for x, y in zip(pair.blocks(targets), pair.blocks(written), strict=True))
        assert pair.sched.get_external_cache_hit_sources(second, 6 * BLOCK) == {
            vllm_stub.CacheHitSource.DISK: 6 * BLOCK}
        # one load per request: asked again, it is offered nothing
        assert pair.sched.get_num_new_matched_tokens(second, 0) == (0, False)
        assert pair.sched.scheduler.stats().tiers.loads_done == 1
    finally:
        pair.close()


def test_a_failed_copy_into_the_kv_cache_comes_back_as_load_errors(tmp_path, connector):
    pair = Pair(connector, vllm_config(tmp_path), kv_cache_config())
    try:
        pair.sched.request_finished(request("a", TOKENS), list(range(6)))
        pair.finished.add("a")
        pair.until(lambda got: "a" in got[0])  # in host RAM now; the worker's transfer exists
        pair.worker.worker.transfer.faults.fail("transfer")  # the next copy raises, as a CUDA error would
        second = request("b", TOKENS, num_computed_tokens=0)
        assert pair.sched.get_num_new_matched_tokens(second, 0) == (6 * BLOCK, True)
        targets = list(range(30, 36))
        pair.sched.update_state_after_alloc(second, SimpleNamespace(get_block_ids=lambda: (targets,)), 6 * BLOCK)
        _, recved, errors = pair.until(lambda got: "b" in got[1])
        assert errors == set(targets)  # vLLM recomputes them
    finally:
        pair.close()


def test_request_class_and_what_is_never_cached(tmp_path, connector):
    pair = Pair(connector, vllm_config(tmp_path), kv_cache_config())
    try:
        s = pair.sched
        assert s._request_class(request("i", TOKENS)) == "interactive"
        assert s._request_class(request("p", TOKENS, priority=1)) == "batch"  # vLLM's integer priority
        assert s._request_class(request("t", TOKENS, kv_transfer_params={"priority": "batch"})) == "batch"
        for kw in ({"lora_request": object()}, {"mm_features": [object()]}, {"prompt_embeds": torch.zeros(1)}):
            assert s.get_num_new_matched_tokens(request("x", TOKENS, **kw), 0) == (0, False)
            assert s.request_finished(request("x", TOKENS, **kw), list(range(6))) == (False, None)
        assert s.reset_cache() is True and pair.worker.reset_cache() is None
    finally:
        pair.close()


@pytest.mark.parametrize(("kw", "kv_kw", "needle"), [
    ({"world_size": 2}, {}, "one worker per engine"),
    ({}, {"sliding_window": 128}, "sliding-window"),
])
def test_unsupported_setups_are_refused_by_name(tmp_path, connector, kw, kv_kw, needle):
    with pytest.raises(ValueError, match=needle):
        connector.TierguardConnector(vllm_config(tmp_path, **kw), vllm_stub.KVConnectorRole.WORKER,
                                     kv_cache_config(**kv_kw))
