"""From raw runs to numbers and a verdict per KV dtype, against the unquantized baseline.

Per context L and dtype:
- retrieval accuracy: share of passkey trials at L answered with the right key (points);
- perplexity: exp(mean NLL) of the text's tokens at positions (L/2, L] -- the tokens
  that see at least L/2 tokens of context, so each context is judged on long-range reads;
- top-1 agreement and max |logit - baseline| over the same positions, teacher-forced.

A dtype passes when, at every context, accuracy drops by at most `max_accuracy_drop`
points and perplexity rises by at most `max_ppl_increase` percent (with `--trials 0`
no passkey runs and perplexity alone decides; the document says so). The bar is relative:
a small model that fails the task unquantized is not failed again for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierguard.kvcheck.inputs import BASELINE

if TYPE_CHECKING:
    from tierguard.kvcheck.runner import DtypeRun, PositionStats


@dataclass
class Thresholds:
    max_accuracy_drop: float = 5.0  # points
    max_ppl_increase: float = 2.0  # percent


def _window(context: int, n_positions: int) -> slice:
    # stat index p predicts token p + 1; tokens L/2 + 1 .. L - 1 of an L-token context.
    # The teacher pass holds longest - 1 tokens (the engine needs room for the one token it
    # samples), so at the longest context the window ends one position earlier.
    return slice(context // 2, min(context - 1, n_positions))


def rows(runs: dict[str, DtypeRun], stats: PositionStats, contexts: list[int], th: Thresholds) -> list[dict]:
    out = []
    n = len(stats.nll[BASELINE])
    for ctx in contexts:
        w = _window(ctx, n)
        base: dict = {}
        for name, run in runs.items():
            trials = [t for t in run.trials if t.context == ctx]
            acc = 100.0 * sum(t.correct for t in trials) / len(trials) if trials else None
            ppl = math.exp(float(stats.nll[name][w].mean()))
            row = {
                "context": ctx,
                "kv_dtype": name,
                "trials": len(trials),
                "retrieval_accuracy": None if acc is None else round(acc, 2),
                "perplexity": round(ppl, 4),
                "positions": w.stop - w.start,
            }
            if name == BASELINE:
                base = row
            else:
                agree = float((stats.top1[name][w] == stats.top1[BASELINE][w]).double().mean())
                # No trials (--trials 0): perplexity alone decides.
                drop = 0.0 if acc is None else base["retrieval_accuracy"] - acc
                rise = 100.0 * (ppl / base["perplexity"] - 1.0)
                row.update(
                    accuracy_drop_points=round(drop, 2),
                    perplexity_increase_pct=round(rise, 3),
                    top1_agreement=round(agree, 4),
                    max_logit_error=round(float(stats.max_logit_err[name][w].max()), 4),
                    mean_max_logit_error=round(float(stats.max_logit_err[name][w].mean()), 5),
                    passed=bool(drop <= th.max_accuracy_drop and rise <= th.max_ppl_increase),
                )
            out.append(row)
    return out


def verdicts(table: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in table:
        if r["kv_dtype"] == BASELINE:
            continue
        v = out.setdefault(r["kv_dtype"], {"passed": True, "failed_contexts": []})
        if not r["passed"]:
            v["passed"] = False
            v["failed_contexts"].append(r["context"])
    return out
