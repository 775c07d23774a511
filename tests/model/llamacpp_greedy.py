"""Greedy decoding under llama.cpp (llama-cpp-python), run by the interpreter that has it.

tests/model/test_gguf_llamacpp.py runs this file with `LLAMA_PYTHON` (make test puts
llama-cpp-python in its own venv) and compares with tierguard's engine. Reads JSON on
stdin: {"gguf": path, "prompts": [[ids]], "steps": n, "ours": [[ids]], "text": str};
writes JSON on stdout:
- "greedy": llama.cpp's own greedy continuation of each prompt (`steps` tokens);
- "forced": its top-1 choice at each step along `ours` (prompt + our tokens), so a first
  difference does not hide what it would have chosen afterwards;
- "tokenized": its tokenization of `text` (BOS added, as its server does).
Default settings, as `python -m llama_cpp.server` runs the file (f16 KV cache); one
context per prompt (`reset`), two threads.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from llama_cpp import Llama


def main() -> None:
    job = json.load(sys.stdin)
    steps = job["steps"]
    longest = max(len(p) for p in job["prompts"]) + steps + 8
    llm = Llama(model_path=job["gguf"], n_ctx=max(512, longest), n_threads=2, logits_all=True, verbose=False)
    greedy, forced = [], []
    for prompt, ours in zip(job["prompts"], job["ours"], strict=True):
        out: list[int] = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == steps:
                break
        greedy.append(out)
        llm.reset()
        llm.eval(prompt + ours[:-1])
        scores = np.asarray(llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(ours)])
        forced.append([int(i) for i in scores.argmax(-1)])
    tokenized = llm.tokenize(job["text"].encode(), add_bos=True, special=False)
    json.dump({"greedy": greedy, "forced": forced, "tokenized": tokenized}, sys.stdout)


if __name__ == "__main__":
    main()
