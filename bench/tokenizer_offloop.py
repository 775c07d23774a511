"""What tokenizing a long prompt costs the event loop: inline, in a thread, in a process.

`tokenizers` holds the GIL while it encodes, so a worker thread does not keep the event
loop (and with it /health and every stream's next chunk) responsive; a worker process
does. This bench encodes the longest prompt that still fits the tiny model
(max_model_len x the longest token, `tokens_fit.py`) `--rounds` times per mode while a
ticker task on the loop sleeps 1 ms at a time, and reports the encode time and the
longest gap the ticker saw.

    .venv/bin/python bench/tokenizer_offloop.py
Prints one JSON document. The run is `"valid"` only if every mode encoded every text to
the same tokens as the inline encoder (a worker that returned nothing, or something
else, would be fast for the wrong reason) and the ticker ran in every mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import string
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tierguard.common.tokenpool import TokenizerPool  # noqa: E402
from tierguard.gate.tokens_fit import token_bytes_of  # noqa: E402
from tierguard.model.tiny import ensure_tiny_model  # noqa: E402
from tierguard.model.tokenizer import HFTokenizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity  # noqa: E402

MODES = ("inline", "thread", "process")


def judge(out: dict) -> dict:
    v = Validity()
    want = out["inline"]["tokens"]
    v.require(want > 0, "the inline encoder produced no tokens")
    for mode in MODES:
        v.require(out[mode]["tokens"] == want and out[mode]["digest"] == out["inline"]["digest"],
                  f"{mode}: {out[mode]['tokens']} tokens, not the inline encoder's {want}")
        v.require(out[mode]["ticks"] > 0, f"{mode}: the loop's ticker never ran")
    return v.as_dict()


async def _measure(encode, texts: list[str]) -> dict:
    gaps: list[float] = []
    stop = False

    async def ticker() -> None:
        last = time.monotonic()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    times = []
    ids: list[int] = []
    for text in texts:
        t = time.monotonic()
        ids += list(await encode(text))
        times.append(time.monotonic() - t)
    stop = True
    await task
    return {"encode_ms_mean": round(1000 * sum(times) / len(times), 1),
            "loop_gap_ms_max": round(1000 * max(gaps), 1), "ticks": len(gaps),
            "tokens": len(ids), "digest": hash(tuple(ids))}


async def main(args: argparse.Namespace) -> dict:
    tok = HFTokenizer(ensure_tiny_model())
    rule = token_bytes_of(tok)
    n = (args.max_model_len - 1) * rule.max_bytes
    rng = random.Random(0)
    texts = ["".join(rng.choice(string.ascii_lowercase + "  ") for _ in range(n)) for _ in range(args.rounds)]
    out: dict = {"prompt_bytes": n, "rounds": args.rounds, "token_max_bytes": rule.max_bytes}

    async def inline(text: str) -> list[int]:
        return tok.encode(text)

    out["inline"] = await _measure(inline, texts)
    for kind in ("thread", "process"):
        pool = TokenizerPool(tok, workers=1, kind=kind)
        await pool.warm()
        try:
            out[kind] = await _measure(pool.encode, texts)
        finally:
            pool.close()
    out.update(judge(out))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    print(json.dumps(asyncio.run(main(p.parse_args())), indent=2))
