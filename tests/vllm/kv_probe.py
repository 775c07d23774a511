"""Build vLLM engines one after another in this process and print what each logs.

Run by tests/vllm with .venv-vllm's Python: `python kv_probe.py CASES.json`, where each
case is {"model", "env", "flags"} as `tierguard plan --engine vllm --target cpu` emits
them. Each case's flags go through vLLM's own server argument parser, its env into
os.environ, then a real engine is built (model loaded, KV pool allocated) and dropped.
One import of vLLM serves every case, which is what makes a handful of model shapes
affordable; the KV pool is sized by the same code as in `vllm serve`.

Prints `@@case N` before each engine and `@@done N TOKENS CONCURRENCY` after it; vLLM's
own log lines (the "CPU KV cache size" line among them) come in between.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process


def main(path: str) -> int:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.llm_engine import LLMEngine

    cases = json.loads(open(path).read())
    base_env = dict(os.environ)
    for i, case in enumerate(cases):
        os.environ.clear()
        os.environ.update({**base_env, **case["env"]})
        if "VLLM_CPU_KVCACHE_SPACE" not in case["env"]:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            ["--model", case["model"], "--enforce-eager", *case["flags"]]
        )
        print(f"@@case {i}", flush=True)
        engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
        cc = engine.vllm_config.cache_config
        print(f"@@done {i} {cc.kv_cache_size_tokens} {cc.kv_cache_max_concurrency}", flush=True)
        del engine
        cleanup_dist_env_and_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
