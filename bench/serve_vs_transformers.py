"""`tierguard serve` vs `transformers serve --continuous-batching` on the same model.

Both servers run as real subprocesses on loopback, one after the other (never at the
same time, so they do not share the CPU), and are driven by the same aiohttp streaming
client: chat completions with a fixed prompt length (default 128 tokens, counted with
the model's own tokenizer and chat template) and a fixed output length (default 64,
greedy, EOS ignored: `ignore_eos` for tierguard, `min_new_tokens` for transformers,
which refuses unknown fields). Every request has a distinct prompt so prefix caching
cannot skip prefill. Prints one JSON document: per server and concurrency, output
tokens/s and p99 inter-token latency (gap between consecutive content events seen by
the client), plus their ratios. Output tokens are counted by this script with the
model's tokenizer on the text each stream delivered (the same counter for both servers;
each server's own `usage` is kept beside it, not trusted). A level is "valid": false
when a request failed or delivered no text, or a server's usage says it generated a
different length than asked; ratios are null unless both sides are valid.

    .venv/bin/python bench/serve_vs_transformers.py [--model DIR] [--concurrency 1,8,32]

Needs `fastapi`, `uvicorn` and `accelerate` for `transformers serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from validity import Validity, count_errors  # noqa: E402

from tierguard.common.percentile import percentile  # noqa: E402

READY = "tierguard serve: ready on "
LOG_DIR = Path(tempfile.gettempdir()) / "tierguard_bench_logs"


@dataclass
class Stream:
    """What the client saw of one request."""

    started: float
    events: list[float] = field(default_factory=list)  # arrival of each content-bearing event
    text: list[str] = field(default_factory=list)  # the content of those events
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


def settle(streams: list[Stream]) -> tuple[list[Stream], list[float], list[float]]:
    """A stream with no content is an error; returns the good ones, their inter-token gaps
    and their TTFTs (seconds)."""
    for st in streams:
        if st.error is None and not st.events:
            st.error = "no content delivered"
    ok = [st for st in streams if st.error is None]
    gaps = [b - a for st in ok for a, b in zip(st.events, st.events[1:], strict=False)]
    return ok, gaps, [st.events[0] - st.started for st in ok]


_pct = percentile  # q in 0..100, None for no values: the one definition (common/percentile.py)


def make_prompts(model_dir: Path, n: int, prompt_tokens: int, seed: int = 0) -> list[str]:
    """`n` distinct user messages whose chat-templated length is exactly `prompt_tokens`."""
    from tierguard.model.tokenizer import HFTokenizer

    tok = HFTokenizer(model_dir)
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def length(text: str) -> int:
        msgs = [{"role": "user", "content": text}]
        return len(
            tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
        )

    prompts = []
    for i in range(n):
        text = f"request {i}:"
        while length(text) < prompt_tokens:
            text += " " + "".join(rng.choice(letters) for _ in range(rng.randint(2, 7)))
        while length(text) > prompt_tokens:  # overshot inside the last word: trim characters
            text = text[:-1]
        if length(text) != prompt_tokens:
            raise SystemExit(f"could not build a prompt of exactly {prompt_tokens} tokens")
        prompts.append(text)
    return prompts


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict) -> Stream:
    st = Stream(started=time.perf_counter())
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                st.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return st
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                now = time.perf_counter()
                if chunk.get("error"):
                    st.error = str(chunk["error"])[:200]
                    break
                for choice in chunk.get("choices") or []:
                    if content := (choice.get("delta") or {}).get("content"):
                        st.events.append(now)
                        st.text.append(content)
                if chunk.get("usage"):
                    st.completion_tokens = chunk["usage"]["completion_tokens"]
                    st.prompt_tokens = chunk["usage"]["prompt_tokens"]
    except aiohttp.ClientError as exc:
        st.error = repr(exc)
    return st


def judge_streams(streams: list[Stream], want_tokens: int) -> Validity:
    """A level is valid when no stream failed and each produced the tokens asked for."""
    v = Validity()
    errors = [st.error for st in streams if st.error]
    v.require(not errors, count_errors(errors))
    ok = [st for st in streams if not st.error]
    short = [st.completion_tokens for st in ok if st.completion_tokens and st.completion_tokens != want_tokens]
    v.require(not short, f"{len(short)} streams' usage says {sorted(set(short))} tokens, {want_tokens} were asked")
    v.require(all(st.text for st in ok), "a stream carried no text")
    return v


async def run_level(url: str, bodies: list[dict], concurrency: int, count_tokens, want_tokens: int) -> dict:
    # Other processes share this machine: the load seen at the start of each level is
    # kept with its numbers so a noisy comparison can be recognised as such.
    load_before = round(os.getloadavg()[0], 2)
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def guarded(body: dict) -> Stream:
            async with sem:
                return await one_stream(s, url, body)

        t0 = time.perf_counter()
        streams = await asyncio.gather(*(guarded(b) for b in bodies))
        wall = time.perf_counter() - t0
    ok, gaps, ttft = settle(streams)
    out_tokens = sum(count_tokens("".join(st.text)) for st in ok)  # our count, not the server's
    events = sum(len(st.events) for st in ok)
    errors = [st.error for st in streams if st.error]
    v = judge_streams(streams, want_tokens)
    return {
        "concurrency": concurrency,
        "loadavg_1m_before": load_before,
        "requests": len(bodies),
        **v.as_dict(),
        "errors": errors[:3],
        "num_errors": len(errors),
        "wall_s": round(wall, 3),
        "output_tokens": out_tokens,
        "usage_output_tokens": sum(st.completion_tokens for st in ok),
        "prompt_tokens_mean": statistics.mean(st.prompt_tokens for st in ok) if ok else None,
        "output_tok_s": round(out_tokens / wall, 2) if wall else None,
        "tokens_per_event": round(out_tokens / events, 3) if events else None,
        "itl_p50_ms": _ms(_pct(gaps, 50)),
        "itl_p99_ms": _ms(_pct(gaps, 99)),
        "ttft_p50_ms": _ms(_pct(ttft, 50)),
        "ttft_p99_ms": _ms(_pct(ttft, 99)),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in its own process group, always stopped on exit."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name, self.cmd = name, cmd
        self.log = open(LOG_DIR / f"{name}.log", "w")  # closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, start_new_session=True
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def start_tierguard(model_dir: Path, args: argparse.Namespace) -> tuple[Server, str]:
    cmd = [
        sys.executable,
        "-m",
        "tierguard",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--dtype",
        args.dtype,
        "--served-model-name",
        "bench",
    ]
    cmd += args.tierguard_args.split() if args.tierguard_args else []
    srv = Server("tierguard", cmd, dict(os.environ))
    deadline = time.time() + args.start_timeout
    assert srv.proc.stdout is not None
    while time.time() < deadline:
        line = srv.proc.stdout.readline()
        if not line:
            srv.stop()
            raise SystemExit(f"tierguard serve exited during startup; see {srv.log.name}")
        if line.startswith(READY):
            return srv, line[len(READY) :].split()[0]
    srv.stop()
    raise SystemExit("tierguard serve did not become ready in time")


async def _wait_health(url: str, proc: subprocess.Popen, timeout: float, path: str = "/health") -> bool:
    """Poll `url + path` until it answers 200 (True), the process exits or time runs out."""
    deadline = time.time() + timeout
    async with aiohttp.ClientSession() as s:
        while time.time() < deadline and proc.poll() is None:
            try:
                async with s.get(url + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return True
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
    return False


def start_transformers(model_dir: Path, args: argparse.Namespace) -> tuple[Server, str]:
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if exe is None:
        raise RuntimeError("the `transformers` CLI is not installed")
    port = _free_port()
    cmd = [
        exe,
        "serve",
        str(model_dir),
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu" if args.device == "cpu" else "auto",
        "--dtype",
        args.dtype,
    ]
    cmd += args.transformers_args.split() if args.transformers_args else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    srv = Server("transformers", cmd, env)
    url = f"http://127.0.0.1:{port}"
    if not asyncio.run(_wait_health(url, srv.proc, args.start_timeout)):
        srv.stop()
        tail = (LOG_DIR / "transformers.log").read_text()[-600:]
        raise RuntimeError(f"transformers serve did not become healthy: {tail}")
    return srv, url


def bodies_for(kind: str, model_id: str, prompts: list[str], out_tokens: int) -> list[dict]:
    out = []
    for p in prompts:
        body: dict = {
            "model": model_id,
            "messages": [{"role": "user", "content": p}],
            "stream": True,
            "temperature": 0.0,
        }
        if kind == "tierguard":
            body |= {"max_tokens": out_tokens, "ignore_eos": True, "stream_options": {"include_usage": True}}
        else:  # transformers refuses ignore_eos/stream_options; usage comes in its last chunk anyway
            body["generation_config"] = json.dumps(
                {"max_new_tokens": out_tokens, "min_new_tokens": out_tokens, "do_sample": False}
            )
        out.append(body)
    return out


def bench_server(kind: str, url: str, model_id: str, args: argparse.Namespace, levels: list[int]) -> dict:
    from tierguard.model.tokenizer import HFTokenizer

    tok = HFTokenizer(args.model_dir)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    endpoint = url + "/v1/chat/completions"
    warm = make_prompts(args.model_dir, 4, args.prompt_tokens, seed=999)
    asyncio.run(run_level(endpoint, bodies_for(kind, model_id, warm, 8), 2, count, 8))
    results = {}
    for c in levels:
        n = max(c * args.rounds, args.min_requests)
        prompts = make_prompts(args.model_dir, n, args.prompt_tokens, seed=c)
        results[str(c)] = asyncio.run(
            run_level(endpoint, bodies_for(kind, model_id, prompts, args.output_tokens), c, count, args.output_tokens)
        )
        print(f"[{kind}] c={c}: {json.dumps(results[str(c)])}", file=sys.stderr, flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: tierguard's built-in tiny model)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="requests per level = concurrency × rounds")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--tierguard-args", default="", help="extra flags for tierguard serve")
    ap.add_argument("--transformers-args", default="", help="extra flags for transformers serve")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.model is None:
        from tierguard.model.tiny import ensure_tiny_model

        args.model_dir = ensure_tiny_model()
    else:
        args.model_dir = Path(args.model)
    levels = [int(x) for x in args.concurrency.split(",")]
    LOG_DIR.mkdir(exist_ok=True)

    report: dict = {
        "bench": "serve_vs_transformers",
        "model_dir": str(args.model_dir),
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "dtype": args.dtype,
        "cpus": os.cpu_count(),
        "levels": levels,
        "tierguard_args": args.tierguard_args,
        "transformers_args": args.transformers_args,
    }
    srv, url = start_tierguard(args.model_dir, args)
    try:
        report["tierguard"] = bench_server("tierguard", url, "bench", args, levels)
    finally:
        srv.stop()
    if not args.skip_transformers:
        try:
            srv, url = start_transformers(args.model_dir, args)
        except RuntimeError as exc:
            report["transformers_error"] = str(exc)
        else:
            try:
                report["transformers"] = bench_server("transformers", url, str(args.model_dir), args, levels)
            finally:
                srv.stop()
    if "transformers" in report:
        import transformers

        report["transformers_version"] = transformers.__version__
        report["ratios"] = {}
        for c in map(str, levels):
            ours, theirs = report["tierguard"][c], report["transformers"][c]
            if not (ours["valid"] and theirs["valid"]):
                report["ratios"][c] = None  # a failed or short run on either side: nothing to compare
                continue
            report["ratios"][c] = {
                "output_tok_s_tierguard_over_transformers": _ratio(
                    ours["output_tok_s"], theirs["output_tok_s"]
                ),
                "p99_itl_transformers_over_tierguard": _ratio(theirs["itl_p99_ms"], ours["itl_p99_ms"]),
            }
    run = Validity([f"{kind} c={c}: {why}" for kind in ("tierguard", "transformers") if kind in report
                    for c, lv in report[kind].items() for why in lv["invalid_reasons"]])
    run.require("transformers" in report or args.skip_transformers,
                f"transformers did not run: {report.get('transformers_error', '?')}")
    report.update(run.as_dict())
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


if __name__ == "__main__":
    sys.exit(main())
