"""Where a step's time goes: torch.profiler over steady-state decode steps, by part.

Why a module of its own: the model and the engine stay free of profiling code. For the
length of `step_scopes(engine)` named `record_function` scopes are put around the parts
(forward hooks on the model's modules, wrappers on a few functions and engine methods);
on exit everything is put back. The parts do not overlap, so their times add up:

    matmul    every linear layer (q/k/v, o, gate/up, down; float or quantized)
    lm_head   the logits of the sampled rows
    attention the paged attention call (KV write, KV read, SDPA); `kv_write`, `kv_read`
              are its share spent storing and gathering the paged KV
    rope      rotary embedding; norm: every RMSNorm; embed: the token embedding
    fused_step  a decode-only step's whole layer stack in one C call (fused_decode.py);
              when the model takes it, the per-module scopes are left out (module
              hooks would send the step down the per-op path), so a step with
              prefill chunks then counts its matmuls etc. under model_rest
    model_rest  the rest of the forward (residual adds, views, the rotary table lookup)
    prepare   schedule -> tensors (block tables, slots, masks)
    sample    the sampler; detok: appending tokens, detokenizing, stop checks
    schedule  the scheduler; engine_rest: the rest of LLMEngine.step

The HTTP path is not in an engine step: `bench/serve_vs_peers.py` measures it as the
client's inter-token gap minus the step time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from torch import nn
from torch.autograd.profiler import record_function

PARTS = (
    "fused_step",
    "matmul",
    "lm_head",
    "attention",
    "kv_write",
    "kv_read",
    "rope",
    "norm",
    "embed",
    "model_rest",
    "prepare",
    "sample",
    "detok",
    "schedule",
    "engine_rest",
)
_PREFIX = "tg."


def _scoped(name: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(_PREFIX + name):
            return fn(*args, **kwargs)

    return wrapper


def _module_part(module: nn.Module) -> str | None:
    kind = type(module).__name__
    if isinstance(module, nn.Linear) or kind.endswith("Linear"):
        return "matmul"
    if kind == "RMSNorm":
        return "norm"
    if isinstance(module, nn.Embedding) or kind.endswith("Embedding"):
        return "embed"
    return None


@contextmanager
def step_scopes(engine: Any) -> Iterator[None]:
    """Named scopes around the parts of `engine.step()`, removed on exit."""
    import tierguard.engine.llm_engine as llm_engine_mod
    import tierguard.model.attention as attention_mod
    import tierguard.model.fused_decode as fused_mod
    import tierguard.model.llama as llama_mod

    model = engine.runner.model
    fused = getattr(model, "_fused_decoder", lambda: None)() is not None
    handles = []
    for module in model.modules():
        part = _module_part(module)
        if part is None or fused:
            continue
        stack: list[record_function] = []

        def pre(_m: nn.Module, _args: Any, part: str = part, stack: list = stack) -> None:
            scope = record_function(_PREFIX + part)
            scope.__enter__()
            stack.append(scope)

        def post(_m: nn.Module, _args: Any, _out: Any, stack: list = stack) -> None:
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    handles.append(model.register_forward_pre_hook(lambda *_: _enter("forward")))
    handles.append(model.register_forward_hook(lambda *_: _exit("forward")))
    patches: list[tuple[Any, str, Any, bool]] = []

    def patch(owner: Any, attr: str, part: str) -> None:
        if hasattr(owner, attr):
            original = getattr(owner, attr)
            patches.append((owner, attr, original, attr in vars(owner)))
            setattr(owner, attr, _scoped(part, original))

    for attr in ("paged_attention", "decode_attention"):
        patch(llama_mod, attr, "attention")
    patch(llama_mod, "apply_rotary", "rope")
    for attr in ("_store", "store_kv"):
        patch(attention_mod, attr, "kv_write")
    for attr in ("_gather", "gather_kv"):
        patch(attention_mod, attr, "kv_read")
    patch(fused_mod.FusedDecoder, "run", "fused_step")
    patch(model, "compute_logits", "lm_head")
    patch(engine.runner, "prepare", "prepare")
    patch(engine.scheduler, "schedule", "schedule")
    patch(llm_engine_mod, "sample", "sample")
    patch(engine, "_on_token", "detok")
    patch(engine, "step", "step")
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for owner, attr, original, own in reversed(patches):
            if own:
                setattr(owner, attr, original)
            else:
                with suppress(AttributeError):
                    delattr(owner, attr)


_open: dict[str, record_function] = {}


def _enter(name: str) -> None:
    scope = record_function(_PREFIX + name)
    scope.__enter__()
    _open[name] = scope


def _exit(name: str) -> None:
    _open.pop(name).__exit__(None, None, None)


def breakdown(events: Any, steps: int) -> dict[str, float]:
    """Milliseconds per step for each part, from `profiler.key_averages()`."""
    total: dict[str, float] = {}
    for ev in events:
        if ev.key.startswith(_PREFIX):
            total[ev.key[len(_PREFIX) :]] = ev.cpu_time_total / 1000.0 / steps
    get = total.get
    out = {p: get(p, 0.0) for p in PARTS if p not in ("model_rest", "engine_rest")}
    # attention includes its KV write/read; matmul here excludes nothing (leaves only)
    leaves = out["fused_step"] + out["matmul"] + out["attention"] + out["rope"] + out["norm"] + out["embed"]
    out["model_rest"] = max(0.0, get("forward", 0.0) - leaves)
    inner = get("forward", 0.0) + sum(out[p] for p in ("lm_head", "prepare", "sample", "detok", "schedule"))
    out["engine_rest"] = max(0.0, get("step", 0.0) - inner)
    out["step"] = get("step", 0.0)
    return {k: round(v, 3) for k, v in out.items()}


def profile_steps(engine: Any, steps: int) -> dict[str, float]:
    """Profile `steps` calls of engine.step() (the caller sets up a steady decode)."""
    from torch.profiler import ProfilerActivity, profile

    with step_scopes(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    out = breakdown(prof.key_averages(), steps)
    out["wall_ms_profiled"] = round(wall / steps * 1000, 3)
    return out


def summary_line(parts: dict[str, float]) -> str:
    """One line: each part's ms per step and share of the step, largest first."""
    step = parts.get("step") or sum(parts.get(p, 0.0) for p in PARTS if p not in ("kv_write", "kv_read"))
    shown = sorted(
        ((p, parts.get(p, 0.0)) for p in PARTS if p not in ("kv_write", "kv_read")), key=lambda kv: -kv[1]
    )
    items = []
    for p, ms in shown:
        if ms <= 0:
            continue
        extra = ""
        if p == "attention":
            extra = f" [kv write {parts.get('kv_write', 0):.2f}, kv read {parts.get('kv_read', 0):.2f}]"
        items.append(f"{p} {ms:.2f} ({100 * ms / step:.0f}%){extra}" if step else f"{p} {ms:.2f}")
    return f"step {step:.2f} ms (profiled) = " + " | ".join(items)
