"""Quality of bfloat16 / weight-only int8 / int4 against the float32 model, on real text.

Teacher-forced, as `tierguard kvcheck` does for the KV pool: each text (default: the
GPL-3, Apache-2.0, MPL-2.0 and LGPL-2.1 texts in /usr/share/common-licenses, or
`--text FILE ...`) is tokenized and cut to `--context` tokens; every model reads the same
tokens through the engine (one prefill, `LLMEngine.generate`), a hook on the final norm
keeps the hidden state of every position, and the model's own lm_head (quantized with
the rest) turns them into logits. Over the last `--positions` positions of each text:

  agreement   share of positions whose top-1 next token equals float32's
  perplexity  exp(mean negative log-likelihood of the actual next token)

Targets: agreement >= 0.98 for bf16 and int8 and >= 0.9 for int4, judged only on a valid
run: one that scored positions of some text, and whose engines really held the narrower
weights (int8 / int4 under half the float32 bytes, bf16 at most half; a float32 engine
would "agree" perfectly).
Prints JSON.

    .venv/bin/python bench/weight_quant_quality.py --model DIR|smollm2 [--weight-dtype bf16,int8,int4]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from validity import Validity  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
DEFAULT_TEXTS = ["GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1"]
TARGETS = {"bf16": 0.98, "int8": 0.98, "int4": 0.9}
MAX_BYTES = {"bf16": 0.51, "int8": 0.5, "int4": 0.5}  # of the float32 bytes (bf16: padding to panels)


def resolve_model(spec: str) -> Path:
    try:
        from tierguard.model.registry import resolve_model as resolve  # tiny, smollm2, a .gguf or a directory
    except ImportError:
        return Path(spec)
    return Path(resolve(spec))


def texts(paths: list[str] | None) -> list[tuple[str, str]]:
    if paths:
        return [(Path(p).name, Path(p).read_text(errors="replace")) for p in paths]
    found = [(n, (LICENSES / n).read_text(errors="replace")) for n in DEFAULT_TEXTS if (LICENSES / n).is_file()]
    if not found:
        raise SystemExit(f"no texts in {LICENSES}; pass --text FILE")
    return found


def hidden_states(
    model_dir: Path, weight_dtype: str, docs: list[list[int]], context: int, group: int, gguf: Path | None = None
):
    """[(hidden [context, H], the engine)] for every doc, read by one engine. `gguf`: the
    GGUF file behind the model, whose Q8_0 / Q4 blocks int8 / int4 layers then take as
    they are (what `tierguard serve --weight-dtype` does)."""
    from tierguard.engine.api import SamplingParams
    from tierguard.engine.factory import build_engine

    engine = build_engine(
        model_dir,
        dtype="float32",
        kv_cache_gib=0.25,
        weight_dtype=weight_dtype,
        int4_group=group,
        gguf_path=gguf if weight_dtype in ("int8", "int4") else None,
        max_model_len=context + 8,
        max_num_batched_tokens=max(512, context),
        enable_prefix_caching=False,
    )
    model = engine.runner.model
    kept: list[torch.Tensor] = []
    handle = model.norm.register_forward_hook(lambda _m, _i, out: kept.append(out.detach().clone()))
    out = []
    for ids in docs:
        kept.clear()
        engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
        out.append(torch.cat([h for h in kept if h.shape[0] > 1])[:context])
    handle.remove()
    return out, engine


@torch.inference_mode()
def logits_of(engine, hidden: torch.Tensor) -> torch.Tensor:
    model = engine.runner.model
    return torch.cat([model.compute_logits(hidden[i : i + 128]).float() for i in range(0, len(hidden), 128)])


def judge(report: dict, v: Validity | None = None) -> dict:
    """Adds validity and each weight kind's `meets_target` to `report`."""
    v = v or Validity()
    v.require(report.get("positions_per_text", 0) > 0 and bool(report.get("texts")), "no position was scored")
    kinds = [wd for wd in report if wd in TARGETS]
    for wd in kinds:
        v.require(report[wd]["bytes_vs_float32"] < MAX_BYTES[wd],
                  f"{wd}: {report[wd]['bytes_vs_float32']} of the float32 bytes: the weights were not quantized")
    for wd in kinds:
        report[wd]["meets_target"] = v.goal(report[wd]["agreement"] >= TARGETS[wd])
    report.update(v.as_dict())
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model directory, or a name the model registry knows")
    ap.add_argument("--weight-dtype", default="int8,int4")
    ap.add_argument("--int4-group", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--positions", type=int, default=256, help="scored positions at the end of each text")
    ap.add_argument("--text", nargs="*", default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    from tierguard.model.gguf_quant import gguf_source
    from tierguard.model.tokenizer import HFTokenizer

    tok = HFTokenizer(model_dir)
    docs, names = [], []
    for name, text in texts(args.text):
        ids = tok.encode(text)
        if len(ids) >= args.context + 1:
            docs.append(ids[: args.context + 1])
            names.append(name)
    v = Validity()
    v.require(bool(docs), f"no text has {args.context + 1} tokens")
    inputs = [d[:-1] for d in docs]
    targets = [torch.tensor(d[1:]) for d in docs]
    lo = args.context - args.positions

    def scores(hid, engine):
        res = []
        for h, tgt in zip(hid, targets, strict=True):
            lg = logits_of(engine, h)[lo:]
            nll = torch.nn.functional.cross_entropy(lg, tgt[lo:], reduction="sum").item()
            res.append((lg.argmax(-1), nll))
        return res

    ref_hidden, ref_engine = hidden_states(model_dir, "auto", inputs, args.context, args.int4_group)
    ref = scores(ref_hidden, ref_engine)
    n_pos = args.positions * len(docs)
    report: dict = {
        "bench": "weight_quant_quality",
        "model_dir": str(model_dir),
        "texts": names,
        "context": args.context,
        "positions_per_text": args.positions,
        "float32": {
            "weight_bytes": ref_engine.runner.weight_bytes,
            "perplexity": round(math.exp(sum(n for _, n in ref) / n_pos), 4),
        },
    }
    ref_engine.close()
    del ref_engine, ref_hidden
    for wd in args.weight_dtype.split(","):
        hid, engine = hidden_states(model_dir, wd, inputs, args.context, args.int4_group, gguf_source(args.model))
        got = scores(hid, engine)
        agree = sum(int((a == r).sum()) for (a, _), (r, _) in zip(got, ref, strict=True)) / n_pos
        per_text = {
            n: round(float((a == r).float().mean()), 4) for n, (a, _), (r, _) in zip(names, got, ref, strict=True)
        }
        ppl = math.exp(sum(n for _, n in got) / n_pos)
        report[wd] = {
            "weight_bytes": engine.runner.weight_bytes,
            "bytes_vs_float32": round(engine.runner.weight_bytes / report["float32"]["weight_bytes"], 4),
            "agreement": round(agree, 4),
            "agreement_per_text": per_text,
            "perplexity": round(ppl, 4),
            "perplexity_vs_float32": round(ppl / report["float32"]["perplexity"], 4),
            "target_agreement": TARGETS.get(wd),
        }
        engine.close()
        print(f"[{wd}] {json.dumps(report[wd])}", file=sys.stderr, flush=True)
    judge(report, v)
    report["threads"] = torch.get_num_threads()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
