"""Human-readable rendering of a plan dict (rich tables); `--json` prints the dict itself."""

from __future__ import annotations

import json
import shlex

from rich.console import Console
from rich.table import Table

from tierguard.common.units import GIB, KIB, MIB


def human(b: float) -> str:
    if b >= GIB:
        return f"{b / GIB:.2f} GiB"
    if b >= MIB:
        return f"{b / MIB:.1f} MiB"
    if b >= KIB:
        return f"{b / KIB:.1f} KiB"
    return f"{int(b)} B"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def to_json(plan: dict) -> str:
    return json.dumps(plan, indent=2, sort_keys=False)


def _model_table(plan: dict) -> Table:
    m, kv, s = plan["model"], plan["kv"], plan["settings"]
    t = Table(title=f"{m['name']} ({m['architecture']})", show_header=False, title_justify="left")
    kinds = ", ".join(f"{n} {k}" for k, n in m["layer_kinds"].items())
    t.add_row("layers", f"{m['num_layers']}: {kinds}")
    attn = f"{m['num_attention_heads']} heads, {m['num_kv_heads']} KV heads, head_dim {m['head_dim']}"
    if m["mla_latent"]:
        attn += f"; MLA latent {m['mla_latent']} (replicated per rank)"
    if m["sliding_window"]:
        attn += f"; sliding window {m['sliding_window']}"
    if m["attention_chunk_size"]:
        attn += f"; chunk {m['attention_chunk_size']}"
    t.add_row("attention", attn)
    t.add_row(
        "weights",
        f"{m['params'] / 1e9:.2f} B params, {plan['weights_dtype']}: {human(plan['weights_bytes'])} "
        f"({human(plan['weights_bytes_per_gpu'])} per GPU, tp={s['tp']} pp={s['pp']})",
    )
    t.add_row(
        "KV per token",
        f"{human(kv['bytes_per_token'])} ({kv['dtype']}, one copy); "
        f"{human(kv['bytes_per_token_per_gpu'])} per GPU ({kv['kv_heads_per_rank']} KV heads per rank)",
    )
    if kv["constant_state_bytes_per_sequence"]:
        t.add_row("constant state", f"{human(kv['constant_state_bytes_per_sequence'])} per sequence")
    if m["defaulted"]:
        filled = ", ".join(f"{k}={v}" for k, v in m["defaulted"].items())
        t.add_row("defaulted", f"not in the config, filled as transformers' {m['family']} defaults: {filled}")
    return t


def _weights_table(plan: dict) -> Table:
    s = plan["settings"]
    t = Table(title=f"Weights per dtype (tp={s['tp']} pp={s['pp']})", title_justify="left")
    for col in ("dtype", "total", "per GPU"):
        t.add_column(col, justify="right")
    for name, w in plan["weights_by_dtype"].items():
        own = " (checkpoint)" if name == plan["weights_dtype"] else ""
        t.add_row(name + own, human(w["total_bytes"]), human(w["per_gpu_bytes"]))
    return t


def _context_table(plan: dict) -> Table:
    t = Table(title="Per context length", title_justify="left")
    conc = plan["max_concurrency"]
    cols = ["context", "KV per sequence", "per GPU"] + (["max concurrency"] if conc else [])
    for col in (*cols, f"x{plan['workload']['concurrency']}"):
        t.add_column(col, justify="right")
    n = plan["workload"]["concurrency"]
    for c, b in plan["kv"]["per_sequence_bytes"].items():
        per_gpu = plan["kv"]["per_sequence_bytes_per_gpu"][c]
        mid = [f"{conc[c]:.2f}x"] if conc else []
        t.add_row(_tokens(int(c)), human(b), human(per_gpu), *mid, human(n * b))
    return t


def _gpu_table(plan: dict) -> Table:
    g = plan["gpu"]
    cpu = plan["settings"]["target"] == "cpu"
    title = f"RAM: {g['name']}" if cpu else f"GPU memory per GPU: {g['name']} x{g['gpus']} (R2)"
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_row("total", human(g["total_bytes"]))
    if cpu:
        t.add_row("usable (after OS, page-cache, burst reserves)", human(g["budget_bytes"]))
    else:
        t.add_row(f"budget (x{g['gpu_memory_utilization']:g})", human(g["budget_bytes"]))
    rules = plan["engine_rules"]
    if rules:
        t.add_row("vLLM rules", f"{rules['version']} -> band {rules['band']}+ ({rules['note']})")
        t.add_row(
            "batching",
            f"max_num_batched_tokens {plan['settings']['max_num_batched_tokens']}, "
            f"max_num_seqs {plan['settings']['max_num_seqs']} ({rules['batching']})",
        )
    t.add_row("  weights", human(g["weights_bytes_per_gpu"]))
    t.add_row("  activation peak", human(g["activation_peak_bytes"]))
    if not cpu:
        t.add_row("  non-torch (cuBLAS, NCCL)", human(g["non_torch_bytes"]))
    t.add_row("  fragmentation reserve", human(g["fragmentation_reserve_bytes"]))
    if g["cuda_graph_in_budget"]:
        t.add_row("  CUDA graphs", human(g["cuda_graph_bytes"]))
    t.add_row("  KV cache", human(g["kv_available_bytes_per_gpu"]))
    if g["shortfall_bytes"]:
        t.add_row("  [red]shortfall[/red]", human(g["shortfall_bytes"]))
    if not cpu:
        graphs = "" if g["cuda_graph_in_budget"] else f" (CUDA graphs ~{human(g['cuda_graph_bytes'])})"
        t.add_row("outside budget", human(g["headroom_bytes"]) + graphs)
    t.add_row("room for KV" if cpu else "GPU KV cache size", f"{g['kv_capacity_tokens']:,} tokens")
    return t


def _host_table(plan: dict) -> Table:
    h = plan["host"]
    t = Table(title=f"Host RAM ({h['source']}) (R6)", show_header=False, title_justify="left")
    t.add_row("total", human(h["total_bytes"]))
    t.add_row(
        "  OS + services / page cache / bursts",
        f"{human(h['os_reserve_bytes'])} / {human(h['page_cache_reserve_bytes'])} / "
        f"{human(h['services_reserve_bytes'])}",
    )
    t.add_row("usable", human(h["usable_bytes"]))
    t.add_row("pinned cap", human(h["pinned_cap_bytes"]))
    t.add_row(
        "KV-offload budget", human(h["kv_offload_budget_bytes"]) + (" (given)" if h["kv_limit_given"] else "")
    )
    t.add_row(
        "weight-offload budget",
        human(h["weights_offload_budget_bytes"]) + (" (given)" if h["weights_limit_given"] else ""),
    )
    t.add_row(
        "planned: KV / weights (host, pinned)",
        f"{human(h['kv_offload_bytes'])} / {human(h['weights_offload_host_bytes'])}",
    )
    t.add_row("left", human(h["left_bytes"]))
    if h["nvme_bytes"]:
        t.add_row("NVMe KV tier", f"{human(h['kv_disk_budget_bytes'])}: prefixes and cold sessions only")
    return t


def _ladder_table(plan: dict) -> Table:
    t = Table(title="Remedy ladder (R7): stops at the first step that fits", title_justify="left")
    for col in ("#", "step", "saves / GPU", "fits", "detail"):
        t.add_column(col)
    for s in plan["ladder"]:
        mark = "[green]yes[/green]" if s["fits"] else "no"
        name = s["step"] if s["applied"] else f"[dim]{s['step']}[/dim]"
        t.add_row(str(s["number"]), name, human(s["saves_bytes"]), mark, s["detail"])
    return t


def _vllm_cpu(plan: dict, con: Console) -> None:
    """vLLM's CPU pool: the two figures of its start-up line, predicted, and how to start it."""
    v = plan["vllm_cpu"]
    t = Table(title=f"vLLM {v['vllm_version']} on CPU: KV pool", show_header=False, title_justify="left")
    t.add_row("pool", f"{human(v['kv_cache_bytes'])} ({v['kv_cache_bytes']:,} B)")
    t.add_row("dtype / KV dtype", f"{v['dtype']} / {v['kv_cache_dtype']}")
    t.add_row("KV per token", f"{v['bytes_per_token']:,} B")
    t.add_row("block", f"{v['block_size']} tokens x all layers = {v['block_bytes']:,} B")
    t.add_row("blocks", f"{v['num_blocks']:,} ({v['blocks_per_request']} per request at {v['max_model_len']:,} tokens)")
    con.print(t)
    con.print(v["log_line"], soft_wrap=True)
    wl = plan["workload"]
    verdict = "[green]fits[/green]" if plan["fits"] else "[red]does not fit[/red]"
    con.print(f"Workload: {wl['concurrency']} x {wl['longest_sequence']:,} tokens: {verdict}")
    for w in plan["warnings"]:
        con.print(f"[yellow]warning:[/yellow] {w}", soft_wrap=True)
    con.print(f"[bold]vllm[/bold]: {v['command']}", soft_wrap=True)


def render(plan: dict, console: Console | None = None) -> None:
    con = console or Console()
    con.print(_model_table(plan))
    if plan.get("vllm_cpu"):
        _vllm_cpu(plan, con)
        return
    con.print(_context_table(plan))
    if plan["gpu"] is None:
        con.print(_weights_table(plan))
        con.print(_host_table(plan))
        for w in plan["warnings"]:
            con.print(f"[yellow]warning:[/yellow] {w}", soft_wrap=True)
        con.print(plan["gpu_needed"], soft_wrap=True)
        return
    con.print(_gpu_table(plan))
    if plan["engine"] == "vllm":
        # The two lines vLLM prints at startup, predicted.
        con.print(f"GPU KV cache size: {plan['gpu']['kv_capacity_tokens']:,} tokens")
        for c, x in plan["max_concurrency"].items():
            con.print(f"Maximum concurrency for {int(c):,} tokens per request: {x:.2f}x")
    wl = plan["workload"]
    verdict = "[green]fits[/green]" if plan["fits"] else "[red]does not fit[/red]"
    con.print(
        f"Workload: {wl['concurrency']} x {wl['longest_sequence']:,} tokens = {human(wl['kv_bytes_per_gpu'])} "
        f"of KV per GPU vs {human(plan['gpu']['kv_available_bytes_per_gpu'])} available: {verdict}"
    )
    if plan["ladder"]:
        con.print(_ladder_table(plan))
        after = "[green]fits[/green]" if plan["fits_after_ladder"] else "[red]still does not fit[/red]"
        con.print(f"After the ladder: {after}")
    if plan["settings"]["target"] != "cpu":
        con.print(_host_table(plan))
    for engine, flags in plan["flags"].items():
        con.print(f"[bold]{engine}[/bold]: {shlex.join(flags)}", soft_wrap=True)
    if plan["tp_trap"]:
        con.print(f"[yellow]{plan['tp_trap']}[/yellow]", soft_wrap=True)
    for w in plan["warnings"]:
        con.print(f"[yellow]warning:[/yellow] {w}", soft_wrap=True)
