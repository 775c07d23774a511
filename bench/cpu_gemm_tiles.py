"""Batched-step matmul in the C kernels: 4 x 3 register tiles against the row-at-a-time loop.

A decode step of more than 8 rows (a batch of decodes, a prefill chunk beside them)
multiplies every weight block by all its rows. `gemm_f32_tiled` (kernels/tiles.c) keeps a
4-row x 3-weight-row tile of accumulators in registers; before it, `gemv_f32_rows` ran
chunks of 8 rows, one loaded x vector per FMA. Both are compiled here from the engine's
own source with its flags (tierguard/model/native.py) into one small harness, and timed
alternately in the same process on SmolLM2's layer shapes (float32 weight rows, as the
int8 / int4 paths widen them per 16-row block), split over OpenMP threads in 16-row
blocks as the engine does. Prints one JSON object: median GFMA/s of each and their ratio.
The two must compute the same products (max |difference| under MAX_DIFF on these inputs,
|y| up to ~80): a fast kernel that computes something else is `"valid": false`.

    python bench/cpu_gemm_tiles.py [--threads 2] [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierguard.model import native  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from validity import Validity  # noqa: E402

MAX_DIFF = 1e-2  # float32 sums of up to 1536 products of |w| <= 0.1, |x| <= 0.5 in another order

SHAPES = [(3072, 576), (576, 1536), (576, 576)]  # gate_up, down, o (N x K)
ROWS = [12, 16, 24, 32, 48, 64]

HARNESS = r"""
#include "tg_kernels.h"
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    const int64_t N = atoll(argv[1]), K = atoll(argv[2]), M_all = atoll(argv[3]);
    const int reps = atoi(argv[4]);
    float *w = malloc(sizeof(float) * N * K), *x = malloc(sizeof(float) * M_all * K), *y = malloc(sizeof(float) * M_all * N);
    float *y2 = malloc(sizeof(float) * M_all * N);
    double *t0 = malloc(sizeof(double) * reps), *t1 = malloc(sizeof(double) * reps);
    for (int64_t i = 0; i < N * K; i++) w[i] = (float)((i * 7919) % 201 - 100) * 1e-3f;
    for (int64_t i = 0; i < M_all * K; i++) x[i] = (float)((i * 104729) % 101 - 50) * 1e-2f;
    for (int r = -2; r < reps; r++)
        for (int mode = 0; mode < 2; mode++) {
            const double t = now();
#pragma omp parallel for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += 16) {
                const int64_t n1 = n0 + 16 < N ? n0 + 16 : N;
                if (mode == 0) gemm_f32_tiled(x, M_all, K, w + n0 * K, n1 - n0, y + n0, N);
                else TG_CHUNKS(gemv_f32_rows(x + m0 * K, M, K, w, n0, n1, y2 + m0 * N, N))
            }
            if (r >= 0) (mode ? t1 : t0)[r] = now() - t;
        }
    double err = 0;
    for (int64_t i = 0; i < M_all * N; i++) { double d = fabs(y[i] - y2[i]); if (d > err) err = d; }
    qsort(t0, reps, sizeof(double), cmp);
    qsort(t1, reps, sizeof(double), cmp);
    printf("%.6f %.6f %.3g\n", t0[reps / 2], t1[reps / 2], err);
    return 0;
}
"""


def build(workdir: Path) -> Path:
    cc = native._compiler()
    if cc is None:
        raise SystemExit("bench/cpu_gemm_tiles.py: no C compiler (cc, gcc or clang) on PATH")
    src = workdir / "harness.c"
    src.write_text(HARNESS)
    exe = workdir / "harness"
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    compile_flags, link_flags = native.compiler_flags(version)
    lto = [f for f in link_flags if f.startswith("-flto")]
    flags = [f for f in compile_flags if f not in ("-fPIC", "-std=c99", "-flto")] + ["-std=gnu99", *lto]
    sources = [str(s) for s in native.SOURCES]
    cmd = [cc, *flags, "-I", str(native.KERNELS), str(src), *sources, "-o", str(exe), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench/cpu_gemm_tiles.py: {cc} failed: {proc.stderr.strip()[-400:]}")
    return exe


def judge(rows: list[dict]) -> dict:
    v = Validity()
    v.require(bool(rows), "no shape was measured")
    for r in rows:
        shape = f"{r['n']}x{r['k']}, {r['rows']} rows"
        v.require(r["max_abs_diff"] < MAX_DIFF, f"{shape}: the tiled and row kernels differ by {r['max_abs_diff']}")
        v.require(r["tiled_gfma_s"] > 0 and r["row_loop_gfma_s"] > 0, f"{shape}: a kernel took no measurable time")
    return v.as_dict()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="tg_tiles_"))
    try:
        exe = build(workdir)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        rows = []
        for n, k in SHAPES:
            for m in ROWS:
                out = subprocess.run(
                    [str(exe), str(n), str(k), str(m), str(args.reps)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split()
                tiled, loop, err = float(out[0]), float(out[1]), float(out[2])
                fma = m * n * k
                rows.append(
                    {
                        "n": n,
                        "k": k,
                        "rows": m,
                        "tiled_gfma_s": round(fma / tiled / 1e9, 1),
                        "row_loop_gfma_s": round(fma / loop / 1e9, 1),
                        "speedup": round(loop / tiled, 2),
                        "max_abs_diff": err,
                    }
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    speedups = sorted(r["speedup"] for r in rows)
    print(
        json.dumps(
            {
                "bench": "cpu_gemm_tiles",
                "threads": args.threads,
                "reps": args.reps,
                "speedup_min": speedups[0],
                "speedup_median": speedups[len(speedups) // 2],
                "speedup_max": speedups[-1],
                **judge(rows),
                "shapes": rows,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
