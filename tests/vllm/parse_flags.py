"""Parse flag lists with the real vLLM server's argument parser, starting nothing.

Run by tests/vllm with .venv-vllm's Python: `python parse_flags.py CASES.json` where
CASES.json is a list of flag lists. Prints one JSON object: for each list, "ok" or the
flags the parser refused (each flag with its value tried alone, so every refused flag
is named, not only the first).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def main(path: str) -> int:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())

    def refused(flags: list[str]) -> str | None:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(["--model", "/models/m", *flags])
        except SystemExit:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "refused"
        return None

    results = []
    for flags in json.loads(open(path).read()):
        if refused(flags) is None:
            results.append({"flags": flags, "ok": True, "refused": []})
            continue
        groups, cur = [], []
        for f in flags:  # a flag and the values after it
            if f.startswith("--") and cur:
                groups.append(cur)
                cur = []
            cur.append(f)
        groups += [cur] if cur else []
        bad = [{"flag": g[0], "why": why} for g in groups if (why := refused(g)) is not None]
        results.append({"flags": flags, "ok": False, "refused": bad})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
