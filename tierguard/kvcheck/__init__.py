"""`tierguard kvcheck`: does KV quantization keep a model's long-context quality? (R7)

R7 asks that KV quantization be checked on long-context tasks, not only on a general
benchmark. This package runs our own engine with each `--kv-dtype` and with the
unquantized pool on identical inputs and compares: passkey retrieval at each context,
perplexity of a long real text, teacher-forced top-1 agreement and logit error.

    inputs.py   the text, the passkey prompts (token ids)
    runner.py   one engine per KV dtype; work reused across contexts and trials
    verdict.py  numbers per context and dtype, pass/fail against the baseline
    check.py    the whole run -> one JSON document; table and plot
"""
