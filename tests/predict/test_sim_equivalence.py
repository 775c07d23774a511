"""The simulated engine makes the real engine's decisions, step by step.

The real LLMEngine (a real model computing real tokens) runs on a test clock that a
pinned cost model advances during each model call; the SimEngine runs the same
configuration with the same cost model on its simulated clock. Both are driven by the
same client (the predictor's driver) with the same workload, and every scheduling
decision (which sequences run, how many tokens each, who is preempted) must match.
Why this is the test that matters: the simulator is meant to run the engine's own
scheduler, step budget and admission, so any copy of a rule (or a clock read that
escaped injection: a step budget fed wall time) shows up as a diverging step.
"""

from __future__ import annotations

import pytest
import torch

from tierguard.engine.api import StepShape
from tierguard.engine.config import EngineConfig
from tierguard.engine.llm_engine import LLMEngine
from tierguard.kv.spec import KVLayout
from tierguard.model.loader import load_model
from tierguard.predict.driver import ClientTiming, Simulation
from tierguard.predict.simengine import EngineSpec, SimClock, SimEngine, SimTokenizer
from tierguard.predict.workload import probe_workload

from .conftest import pinned_cost, record_decisions

CLIENT = ClientTiming(send_s=0.002, deliver_s=0.001)


def real_engine(tiny_dir, config: EngineConfig, cost, clock: SimClock) -> LLMEngine:
    model, cfg, dtype, device = load_model(tiny_dir, "float32", "cpu")
    engine = LLMEngine(model, cfg, SimTokenizer(), config, dtype, device, model_name="tiny", clock=clock)
    run = engine.runner.run

    def pinned(batch):
        out = run(batch)  # the real model computes; the clock moves by the pinned cost
        clock.sleep(cost.step_seconds(StepShape.of(batch)))
        return out

    engine.runner.run = pinned
    return engine


def sim_engine(tiny_dir, config: EngineConfig, cost, clock: SimClock) -> SimEngine:
    from tierguard.model.config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_dir)
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size, "float32")
    return SimEngine(EngineSpec(config, cfg, layout, "tiny"), cost, None, clock)


CASES = {
    # chunked prefill under --target-itl-ms: chunk sizes come from the step budget's
    # estimates, which are learned from the (pinned) step durations
    "target-itl": dict(num_blocks=400, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
                       max_model_len=256, target_itl_ms=12.0),
    # a pool too small for the batch: preemption by recompute, prefix-cache hits on re-admission
    "preempting": dict(num_blocks=70, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
                       max_model_len=256, target_itl_ms=12.0),
    # latency first: SLO waves, held last tokens, admission refusals
    "itl-slo": dict(num_blocks=400, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
                    max_model_len=256, itl_slo_ms=14.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_simulated_engine_decides_as_the_real_one(case, tiny_dir):
    torch.manual_seed(0)
    cost = pinned_cost(gap_ms=(0.3, 0.05))
    runs = []
    for make in (real_engine, sim_engine):
        clock = SimClock(100.0)
        engine = make(tiny_dir, EngineConfig(**CASES[case]), cost, clock)
        decisions = record_decisions(engine)
        durations: list[float] = []
        engine.add_step_listener(lambda stats, durations=durations: durations.append(stats.duration_s))
        sim = Simulation(engine, clock, cost, CLIENT)
        sim.warm_up()
        records = []
        for c, n in ((1, 1), (3, 4), (6, 7)):
            records += sim.run(probe_workload(40, 10, c, n, seed=c, vocab=500))
            sim.pause()
        # a step lasts what its pinned cost moved the engine's clock, never wall time
        assert durations and all(0 < d < 1 for d in durations), (min(durations), max(durations))
        runs.append((decisions, [(r.first_token_s, r.end_s, r.output_tokens) for r in records], clock.now))
    (real_dec, real_rec, real_end), (sim_dec, sim_rec, sim_end) = runs
    assert len(real_dec) > 40
    first = next((i for i, (a, b) in enumerate(zip(real_dec, sim_dec, strict=False)) if a != b), None)
    assert first is None, f"step {first}: real {real_dec[first]} != simulated {sim_dec[first]}"
    assert len(real_dec) == len(sim_dec)
    assert real_rec == sim_rec
    assert real_end == pytest.approx(sim_end)
    if case == "preempting":
        assert any(p for _, p in real_dec), "the small pool never preempted: the case tests nothing"
