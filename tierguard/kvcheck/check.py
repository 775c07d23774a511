"""One kvcheck run: inputs -> runs per dtype -> a JSON document (+ table, plot)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tierguard.common.errors import TierguardError
from tierguard.kvcheck.inputs import ANSWER_TOKENS, BASELINE, PromptBuilder, load_text
from tierguard.kvcheck.verdict import Thresholds, rows, verdicts

KV_DTYPES = ("int8", "fp8")
FORMAT = "tierguard-kvcheck/1"


@dataclass
class CheckSpec:
    model: str  # what the user named ('smollm2', a dir, a .gguf)
    kv_dtypes: list[str]
    contexts: list[int]
    trials: int = 20
    seed: int = 0
    text: str | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    device: str = "cpu"
    threads: int | None = None
    chunk: int | None = None  # None: min(512, shortest context / 4)

    def prefill_chunk(self) -> int:
        """Chunks after the first read K/V back from the (quantized) pool; the first attends
        to its own unquantized K/V. So each context's window (L/2, L] must lie past the
        first chunk, or the teacher-forced numbers would not see quantization at all."""
        return self.chunk or max(16, min(512, min(self.contexts) // 4))

    def validate(self) -> None:
        bad = [d for d in self.kv_dtypes if d not in KV_DTYPES]
        if bad or not self.kv_dtypes:
            raise TierguardError(f"--kv-dtype takes {', '.join(KV_DTYPES)} (comma-separated), got {bad or 'none'}")
        if self.trials < 0:
            raise TierguardError(f"--trials must be >= 0 (0: perplexity and agreement only), got {self.trials}")
        if self.thresholds.max_accuracy_drop < 0 or self.thresholds.max_ppl_increase < 0:
            raise TierguardError("--max-accuracy-drop and --max-ppl-increase must be >= 0")
        if self.chunk is not None and not 16 <= self.chunk <= min(self.contexts) // 2:
            raise TierguardError(
                f"--chunk must be 16 .. half the shortest context ({min(self.contexts) // 2}), got {self.chunk}"
            )


def run_check(spec: CheckSpec, progress=None, checkpoint=None) -> dict:
    """The whole check; returns the JSON document (every number, the verdicts).

    `checkpoint(doc)` is called after each context with the document so far (contexts
    done only), so a long run that is stopped still leaves its shorter contexts."""
    from tierguard.kvcheck import runner as kr  # torch: only once the check runs
    from tierguard.model.config import ModelConfig
    from tierguard.model.registry import model_name, resolve_model
    from tierguard.model.tokenizer import HFTokenizer

    spec.validate()
    source = load_text(spec.text)
    model_dir = resolve_model(spec.model)
    cfg = ModelConfig.from_dir(model_dir)
    longest = max(spec.contexts)
    if longest > cfg.max_exact_len:
        raise TierguardError(f"context {longest} exceeds the model's limit of {cfg.max_exact_len} tokens")
    tok = HFTokenizer(model_dir)
    builder = PromptBuilder(tok, source.text, longest)
    t0 = time.perf_counter()
    sessions: list[kr.DtypeSession] = []
    try:
        for kv_dtype in [BASELINE, *spec.kv_dtypes]:
            s = kr.DtypeSession(
                model_dir, kv_dtype, min(cfg.max_exact_len, longest + 16), device=spec.device,
                threads=spec.threads, chunk=spec.prefill_chunk(),
                max_wave=kr.wave_size(min(spec.contexts), max(1, spec.trials)),
            )  # fmt: skip
            sessions.append(s)
            # A context counts everything the engine holds: prompt + the one sampled token
            # (teacher pass), or prompt + answer (trials).
            s.teacher(builder.teacher_ids(longest - 1))
            if spec.trials:
                s.warm(builder.haystack_ids(longest - ANSWER_TOKENS))
        runs = {s.run.kv_dtype: s.run for s in sessions}
        stats = kr.position_stats(runs, builder.teacher_ids(longest - 1))
        meta = {
            "model": model_name(spec.model, model_dir),
            "model_dir": str(model_dir),
            "model_shape": f"{cfg.num_layers}L h{cfg.hidden_size} kv{cfg.num_kv_heads}x{cfg.head_dim}",
            "text": {"name": source.name, "files": source.files, "tokens_used": longest},
        }
        done: list[int] = []
        doc: dict = {}
        for ctx in spec.contexts:
            trials = builder.trials(ctx, spec.trials, spec.seed, ANSWER_TOKENS)
            for s in sessions:
                s.trials(trials, tok.decode, progress)
            done.append(ctx)
            doc = _document(spec, meta, runs, stats, done, time.perf_counter() - t0)
            if checkpoint is not None:
                checkpoint(doc)
        return doc
    finally:
        for s in sessions:
            s.close()


def _document(spec: CheckSpec, meta: dict, runs: dict, stats, contexts: list[int], elapsed: float) -> dict:
    """Everything measured so far, as JSON-ready values."""
    table = rows(runs, stats, contexts, spec.thresholds)
    verdict = verdicts(table)
    return {
        "format": FORMAT,
        **meta,
        "baseline": f"{BASELINE} (the model dtype, float32: unquantized)",
        "kv_dtypes": spec.kv_dtypes,
        "contexts": contexts,
        "complete": contexts == spec.contexts,
        "trials_per_context": spec.trials,
        "passkey_run": spec.trials > 0,
        "seed": spec.seed,
        "passkey": "5-digit key at stratified depths in repetitive filler; correct = first number answered",
        "perplexity_window": "tokens at positions (L/2, L] of each context L, teacher-forced",
        "prefill_chunk": spec.prefill_chunk(),
        "thresholds": asdict(spec.thresholds),
        "results": table,
        "verdicts": verdict,
        "passed": all(v["passed"] for v in verdict.values()),
        "trials": {name: [asdict(t) for t in run.trials] for name, run in runs.items()},
        "timing_s": {
            name: {"teacher_forced": round(run.teacher_s, 1), "passkey_trials": round(run.trials_s, 1)}
            for name, run in runs.items()
        }
        | {"total": round(elapsed, 1)},
    }


def table_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    """The result table as text cells (terminal, markdown, HTML)."""
    header = ["context", "KV", "passkey", "perplexity", "Δppl", "top-1 agree", "max |Δlogit|", "verdict"]
    out = []
    for r in doc["results"]:
        base = r["kv_dtype"] == BASELINE
        out.append(
            [
                str(r["context"]),
                "baseline" if base else r["kv_dtype"],
                f"{r['retrieval_accuracy']:.0f}% ({r['trials']})" if r["trials"] else "not run",
                f"{r['perplexity']:.3f}",
                "" if base else f"{r['perplexity_increase_pct']:+.2f}%",
                "" if base else f"{r['top1_agreement']:.4f}",
                "" if base else f"{r['max_logit_error']:.3f}",
                "" if base else ("pass" if r["passed"] else "FAIL"),
            ]
        )
    return header, out


def report_section(run_dir: Path):
    """(Table, (caption, png bytes)) for a sweep report when RUN_DIR/kvcheck/kvcheck.json
    exists (the demo's real-model section), else None."""
    from tierguard.report.tables import Table

    path = Path(run_dir) / "kvcheck" / "kvcheck.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    header, body = table_rows(doc)
    verdict = ", ".join(f"{k} {'PASS' if v['passed'] else 'FAIL'}" for k, v in doc["verdicts"].items())
    note = (
        f"tierguard kvcheck on {doc['model']} ({doc['model_shape']}): {doc['trials_per_context']} passkey trials "
        f"per context; perplexity of {doc['text']['name']} over {doc['perplexity_window']}; pass = accuracy drop "
        f"<= {doc['thresholds']['max_accuracy_drop']} points and perplexity rise <= "
        f"{doc['thresholds']['max_ppl_increase']}% vs the unquantized pool. Verdict: {verdict}."
    )
    png = plot(doc, path.with_suffix(".png")).read_bytes()
    table = Table(f"KV quantization on a real model (R7): {doc['model']}", header, body, note)
    return table, ("kvcheck: passkey accuracy and perplexity vs context, per KV dtype", png)


def plot(doc: dict, path: Path) -> Path:
    """Passkey accuracy and perplexity vs context, one line per KV dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    names = [BASELINE, *doc["kv_dtypes"]]
    for name in names:
        rs = [r for r in doc["results"] if r["kv_dtype"] == name]
        label = "baseline" if name == BASELINE else name
        x = [r["context"] for r in rs]
        acc = [float("nan") if r["retrieval_accuracy"] is None else r["retrieval_accuracy"] for r in rs]
        a1.plot(x, acc, marker="o", label=label)
        a2.plot(x, [r["perplexity"] for r in rs], marker="o", label=label)
    for ax, title in ((a1, "passkey retrieval accuracy (%)"), (a2, "perplexity, positions (L/2, L]")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    a1.set_ylim(-5, 105)
    a1.legend(fontsize=8)
    fig.suptitle(f"kvcheck: {doc['model']} ({doc['trials_per_context']} trials per context)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(doc: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "kvcheck.json", "png": out_dir / "kvcheck.png", "md": out_dir / "kvcheck.md"}
    files["json"].write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, files["png"])
    header, body = table_rows(doc)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    files["md"].write_text("\n".join(lines) + "\n")
    return files
