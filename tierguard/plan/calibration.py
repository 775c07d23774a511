"""Leave-one-out check of `tierguard plan` against public vLLM startup logs.

For every log row: fit the reserve coefficients on all other rows, plan the row's run
from its model config and settings alone (catalogue GPU total, our weight estimate, the
fitted reserves of its version band), and compare the KV capacity with the logged one.
Capacity is compared as vLLM prints it ("GPU KV cache size: N tokens"); where a source
gives only "Available KV cache memory", both sides are converted with the same page size
(`derived`), so the relative error is that of the available memory.

    python -m tierguard.plan.calibration            # markdown table (docs/plan-calibration.md)
    python -m tierguard.plan.calibration --json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass

from tierguard.common.units import GIB, MIB
from tierguard.plan.fit import LogRow, fit_band, load_rows
from tierguard.plan.inputs import PlanInputs
from tierguard.plan.planner import make_plan
from tierguard.plan.reserves import Reserves


@dataclass
class Prediction:
    id: str
    model: str
    gpu: str
    version: str
    band: str
    tp: int
    pp: int
    util: float
    logged_tokens: int
    predicted_tokens: int
    derived: bool  # logged tokens converted from the logged available memory
    logged_avail_gib: float
    predicted_avail_gib: float
    error: float  # (predicted - logged) / logged
    excluded: str | None


def predict(row: LogRow, reserves: Reserves | None = None) -> dict:
    """Plan the row's run; `reserves` None means the shipped fit."""
    r = row.raw
    plan = make_plan(
        PlanInputs(
            model=r["model"],
            gpu=r["gpu"],
            tp=r["tp"],
            pp=r["pp"],
            gpu_memory_utilization=r["gpu_memory_utilization"],
            max_model_len=r["max_model_len"],
            contexts=[r["max_model_len"] or 2048],
            max_num_batched_tokens=r["max_num_batched_tokens"],
            max_num_seqs=r["max_num_seqs"],
            weights_dtype=r["weights_dtype"],
            kv_dtype=r["kv_dtype"],
            block_size=r["block_size"],
            prefix_caching=r["prefix_caching"],
            engine="vllm",
            engine_version=r["vllm_version"],
            host_ram_gib=64,
            allow_kv_quant=False,
            reserve_fit=reserves,
        )
    )
    return plan["gpu"]


def leave_one_out(rows: list[LogRow] | None = None) -> list[Prediction]:
    rows = load_rows() if rows is None else rows
    out = []
    for row in rows:
        others = [o for o in rows if o.id != row.id]
        g = predict(row, fit_band(row.band, others))
        block = row.raw["block_size"]
        page = g["page_bytes"]
        logged_avail = row.logged["kv_available_gib"]
        logged = row.logged.get("kv_tokens")
        derived = logged is None
        if derived:
            logged = int(logged_avail * GIB // page) * block
        pred = g["kv_capacity_tokens"]
        out.append(
            Prediction(
                id=row.id,
                model=row.raw["model"],
                gpu=row.raw["gpu"],
                version=row.raw["vllm_version"],
                band=row.band,
                tp=row.raw["tp"],
                pp=row.raw["pp"],
                util=row.raw["gpu_memory_utilization"],
                logged_tokens=logged,
                predicted_tokens=pred,
                derived=derived,
                logged_avail_gib=logged_avail,
                predicted_avail_gib=round(g["kv_available_bytes_per_gpu"] / GIB, 2),
                error=(pred - logged) / logged if logged else float("inf"),
                excluded=row.raw.get("exclude"),
            )
        )
    return out


def summary(preds: list[Prediction]) -> dict[str, dict]:
    """Per version band (and all): rows, median and worst absolute error of included rows."""
    groups: dict[str, list[float]] = {}
    for p in preds:
        if p.excluded:
            continue
        groups.setdefault(p.band, []).append(abs(p.error))
        groups.setdefault("all", []).append(abs(p.error))
    order = sorted((b for b in groups if b != "all"), key=lambda b: tuple(int(x) for x in b.split("."))) + [
        "all"
    ]
    return {
        band: {
            "rows": len(groups[band]),
            "median_abs_error": statistics.median(groups[band]),
            "worst_abs_error": max(groups[band]),
        }
        for band in order
        if band in groups
    }


def markdown(preds: list[Prediction]) -> str:
    lines = [
        "| row | model | GPU | vLLM | TP | PP | util | logged tokens | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in preds:
        mark = " (derived)" if p.derived else ""
        err = f"{p.error * 100:+.1f}%" + (" excluded" if p.excluded else "")
        lines.append(
            f"| {p.id} | {p.model} | {p.gpu} | {p.version} | {p.tp} | {p.pp} | {p.util:g} | "
            f"{p.logged_tokens:,}{mark} | {p.predicted_tokens:,} | {err} |"
        )
    lines += ["", "| vLLM band | rows | median abs error | worst abs error |", "|---|---|---|---|"]
    for band, s in summary(preds).items():
        lines.append(
            f"| {band} | {s['rows']} | {s['median_abs_error'] * 100:.1f}% | {s['worst_abs_error'] * 100:.1f}% |"
        )
    return "\n".join(lines)


def coefficients_markdown() -> str:
    """The shipped fit (all usable rows) per band, as the planner uses it."""
    from tierguard.plan.fit import fitted
    from tierguard.plan.reserves import BANDS

    lines = [
        "| band | forward scale | bytes/logit | offset | non-torch 1 GPU | non-torch TP | "
        "graph estimate | activation rows |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in BANDS:
        f = fitted(b.name)
        act = f"{f.rows['activation']}" + ("" if f.rows["activation_band"] else " (older band's)")
        lines.append(
            f"| {b.name} | {f.forward_scale:.2f} | {f.bytes_per_logit:.1f} | {f.activation_offset / GIB:.2f} GiB | "
            f"{f.non_torch_single / GIB:.2f} GiB | {f.non_torch_tp / GIB:.2f} GiB | "
            f"{f.graph_offset / GIB:.2f} GiB + {f.graph_bytes_per_layer / MIB:.1f} MiB/layer | {act} |"
        )
    return "\n".join(lines)


def report(preds: list[Prediction] | None = None) -> str:
    """The generated part of docs/plan-calibration.md."""
    return (
        markdown(leave_one_out() if preds is None else preds)
        + "\n\nFitted on all usable rows (what `tierguard plan` ships):\n\n"
        + (coefficients_markdown())
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tierguard.plan.calibration", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--json", action="store_true", help="print predictions and summary as JSON")
    args = ap.parse_args(argv)
    preds = leave_one_out()
    if args.json:
        print(json.dumps({"rows": [asdict(p) for p in preds], "summary": summary(preds)}, indent=2))
    else:
        print(report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
