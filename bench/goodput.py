"""Goodput, raw throughput and distance to the arithmetic limit, from serve_vs_peers' servers.

A server, to these functions, is one engine at one setting (`vllm-bf16@b256`: vLLM bfloat16 with its
own knobs; `tierguard-bf16@slo40`: ours with `--itl-slo-ms 40`); the engine is the part
of the name before the first "-". Every function takes the `servers` mapping of a
serve_vs_peers report (name -> {"server", "agreement", "levels"}) and only reads it.

- `table`: per concurrency and p99-gap bound, each engine's highest output tok/s over
  its settings whose p99 inter-token gap stayed under the bound. A level counts only
  when it is valid and its weights pass their quality bar (`MIN_AGREEMENT`: a quantized
  row cannot buy speed with wrong tokens). For tierguard the bar is on the teacher-forced
  top-1 agreement with float32 of its weight format (`quality`: bench/weight_quant_quality.py
  in the same run, the same code and weights the server runs); for another engine, on its
  greedy text's agreement with the float32 reference (stricter: one early divergence
  costs the rest of the answer).
- `targets`: tierguard >= vLLM in every goodput cell (a cell vLLM cannot reach at any
  setting is ours when we reach it); raw C=32 tok/s without an SLO >= vLLM's best raw
  setting, with our p99 gap <= 4 x our own C=1 ITL; C=1 ITL <= 0.6 x vLLM's best;
  TTFT p50 at C=32 <= that vLLM setting's.
- `flops_per_token` and `peak_rows`: each level's achieved FLOP/s (prompt and output
  tokens times the linear layers' FLOPs per token) over the peak of the multiply-add
  its weights compute with, measured in the same run.
"""

from __future__ import annotations

import json
from pathlib import Path

BOUNDS_MS = (50, 100, 200)
GOODPUT_LEVELS = (8, 32)
# Greedy agreement with the float32 reference a quantized server needs for its levels to count.
MIN_AGREEMENT = {"int8": 0.98, "q8_0": 0.98, "int4": 0.9, "q4_1": 0.9}
# The multiply-add each server's weights compute with (bench peak kinds, model/native.py);
# tierguard's int8 and int4 are weight-only (widened to float32 before the multiply).
PEAK_KIND = {"bf16": "bfloat16_dot", "q8_0": "int8_dot", "q4_1": "int8_dot"}


def engine_of(name: str) -> str:
    return name.split("-", 1)[0]


def weights_of(name: str) -> str:
    """The weight format in a server name, the part after the engine: tierguard-int8@slo12
    -> int8, vllm-f32-default-threads -> f32; "" for a name without one (transformers)."""
    return ([*name.split("@", 1)[0].split("-"), ""])[1]


def quality_ok(name: str, result: dict, quality: dict | None = None) -> bool:
    need = MIN_AGREEMENT.get(weights_of(name))
    if need is None:
        return True
    if engine_of(name) == "tierguard":
        agree = ((quality or {}).get(weights_of(name)) or {}).get("agreement")
    else:
        agree = (result.get("agreement") or {}).get("agreement")
    return agree is not None and agree >= need


def _level(result: dict, c: int) -> dict | None:
    lv = result.get("levels", {}).get(str(c))
    return lv if lv and lv.get("valid") and lv.get("itl_p99_ms") is not None else None


def table(servers: dict, quality: dict | None = None, bounds=BOUNDS_MS, levels=GOODPUT_LEVELS) -> dict:
    """{"c8_p99_le_50ms": {engine: {"server", "output_tok_s", "itl_p99_ms"}}, ...}; an engine
    missing from a cell reached that bound at none of its settings."""
    out: dict = {}
    for c in levels:
        for bound in bounds:
            cell: dict = {}
            for name, res in servers.items():
                lv = _level(res, c)
                if lv is None or lv["itl_p99_ms"] > bound or not quality_ok(name, res, quality):
                    continue
                best = cell.get(engine_of(name))
                if best is None or lv["output_tok_s"] > best["output_tok_s"]:
                    cell[engine_of(name)] = {"server": name, "output_tok_s": lv["output_tok_s"],
                                             "itl_p99_ms": lv["itl_p99_ms"]}
            out[f"c{c}_p99_le_{bound}ms"] = cell
    return out


def _raw(servers: dict, engine: str, c: int, quality: dict | None) -> tuple[str, dict] | tuple[None, None]:
    """The engine's setting with the most output tok/s at `c` among those without an SLO."""
    best = (None, None)
    for name, res in servers.items():
        lv = _level(res, c)
        slo = "--itl-slo-ms" in (res.get("server", {}).get("extra_flags") or "")
        if engine_of(name) != engine or lv is None or slo or not quality_ok(name, res, quality):
            continue
        if best[1] is None or lv["output_tok_s"] > best[1]["output_tok_s"]:
            best = (name, lv)
    return best


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def targets(servers: dict, goodput: dict, quality: dict | None = None) -> dict:
    """True/False per goal, None where a side is missing (no valid level to compare)."""
    out: dict = {"goodput_cells": {}}
    for key, cell in goodput.items():
        ours, theirs = cell.get("tierguard"), cell.get("vllm")
        out["goodput_cells"][key] = (None if ours is None and theirs is None else
                                     ours is not None and (theirs is None or
                                                           ours["output_tok_s"] >= theirs["output_tok_s"]))
    cells = out["goodput_cells"].values()
    out["tierguard_ge_vllm_every_goodput_cell"] = None if None in cells else all(cells)
    ours_name, ours = _raw(servers, "tierguard", 32, quality)
    theirs_name, theirs = _raw(servers, "vllm", 32, quality)
    out["raw_c32"] = {"tierguard": ours_name, "vllm": theirs_name,
                      "tok_s_ratio": _ratio(ours and ours["output_tok_s"], theirs and theirs["output_tok_s"]),
                      "ttft_p50_ratio": _ratio(ours and ours["ttft_p50_ms"], theirs and theirs["ttft_p50_ms"])}
    r = out["raw_c32"]["tok_s_ratio"]
    out["raw_c32_tok_s_ge_vllm"] = None if r is None else r >= 1.0
    r = out["raw_c32"]["ttft_p50_ratio"]
    out["c32_ttft_p50_le_vllm"] = None if r is None else r <= 1.0
    own_c1 = _level(servers.get(ours_name, {}), 1) if ours_name else None
    r = _ratio(ours and ours["itl_p99_ms"], own_c1 and own_c1["itl_p50_ms"])
    out["raw_c32_p99_gap_over_own_c1_itl"] = r
    out["raw_c32_p99_gap_le_4x_own_c1_itl"] = None if r is None else r <= 4.0

    def best_c1(engine: str) -> float | None:
        itls = [lv["itl_p50_ms"] for n, res in servers.items()
                if engine_of(n) == engine and quality_ok(n, res, quality)
                for lv in [_level(res, 1)] if lv]
        return min(itls) if itls else None

    r = _ratio(best_c1("tierguard"), best_c1("vllm"))
    out["c1_itl_over_vllm_best"] = r
    out["c1_itl_le_0.6x_vllm_best"] = None if r is None else r <= 0.6
    return out


def flops_per_token(model_dir: Path) -> dict:
    """2 x the multiply-adds of the linear layers per token, from the model's config.json:
    "prompt" for a prompt token (no output head), "output" for a generated one (with it).
    Attention's own work (scores, softmax) is left out."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    body = 2.0 * layers * per_layer
    return {"prompt": body, "output": body + 2.0 * h * cfg["vocab_size"]}


def peak_rows(servers: dict, peaks: dict, fpt: dict, prompt_tokens: int) -> dict:
    """Per server and level: achieved GFLOP/s and its fraction of the peak of the
    multiply-add kind its weights use (float32 FMA unless PEAK_KIND says otherwise)."""
    out: dict = {}
    for name, res in servers.items():
        kind = PEAK_KIND.get(weights_of(name), "float32_fma")
        peak = peaks.get(kind)
        row = {"peak_kind": kind}
        for c, lv in res.get("levels", {}).items():
            if not lv.get("valid") or not lv.get("wall_s"):
                continue
            flops = (lv["requests"] * prompt_tokens * fpt["prompt"] + lv["output_tokens"] * fpt["output"]) / lv["wall_s"]
            row[c] = {"gflop_s": round(flops / 1e9, 1), "fraction": round(flops / peak, 4) if peak else None}
        out[name] = row
    return out
