"""Which engine a variant starts, and what its command line says about its policy.

`tierguard serve` is simulated with its own scheduler (simengine.py), so its command is
only rewritten for calibration: the compute probe keeps every flag that changes what a
step costs, the tiers included, and drops the KV budget (a calibration is then shared
by the variants that differ only there). Other engines are black boxes
with a known batching policy, read from their flags (and, for vLLM, its log):

    vllm            max_num_seqs, max_num_batched_tokens (chunked prefill), block size,
                    max_model_len, prefix caching; the KV pool from its log line
                    "KV cache size: N tokens" (flags: 128 seqs, 2048 tokens on CPU)
    llamacpp-python one request at a time (its server serializes completions); the
                    prompt in --n_batch pieces; --n_ctx tokens of KV
    llama-server    -np slots, -b batch, -c context shared by the slots
    openai          any other server: continuous batching without limits known
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from dataclasses import dataclass, field

from tierguard.sweep.matrix import Variant

PROBE_DROP = ("--kv-cache-gib", "--port", "--step-log", "--host")
PLACEHOLDERS = {"{port}": "0", "{workdir}": "/nonexistent", "{python}": "python", "{base_url}": "http://x"}


@dataclass
class EngineCommand:
    kind: str  # tierguard | vllm | llamacpp-python | llama-server | openai
    argv: list[str]  # with the matrix's placeholders unreplaced
    tail_at: int = 0  # index of the engine's own flags (after `serve` / the module name)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def tail(self) -> list[str]:
        return self.argv[self.tail_at:]


def _argv(variant: Variant) -> list[str]:
    cmd = variant.command
    if cmd is None:
        return []
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def classify(variant: Variant) -> EngineCommand:
    argv = _argv(variant)
    for i, tok in enumerate(argv):
        base = os.path.basename(tok)
        if base == "tierguard" and i + 1 < len(argv) and argv[i + 1] == "serve":
            return EngineCommand("tierguard", argv, i + 2, dict(variant.env))
        if tok == "vllm.entrypoints.openai.api_server" or (base == "vllm" and argv[i + 1:i + 2] == ["serve"]):
            return EngineCommand("vllm", argv, i + 1 + (base == "vllm"), dict(variant.env))
        if tok == "llama_cpp.server":
            return EngineCommand("llamacpp-python", argv, i + 1, dict(variant.env))
        if base == "llama-server":
            return EngineCommand("llama-server", argv, i + 1, dict(variant.env))
    return EngineCommand("openai", argv, len(argv), dict(variant.env))


def _serve_parser() -> argparse.ArgumentParser:
    from tierguard.cli import serve

    return serve.add_parser(argparse.ArgumentParser().add_subparsers())


def _fill(tok: str) -> str:
    for k, v in PLACEHOLDERS.items():
        tok = tok.replace(k, v)
    return tok


def serve_args(cmd: EngineCommand) -> argparse.Namespace:
    """`tierguard serve`'s parsed flags (placeholders filled with stand-ins)."""
    return _serve_parser().parse_args([_fill(t) for t in cmd.tail])


def compute_probe_argv(cmd: EngineCommand) -> list[str]:
    """The serve command without the KV budget and the port, plus a step log. A step's
    cost does not depend on the pool's size, so variants that differ only there share
    one calibration. The tiers stay: their write-behind (a finished request's blocks
    copied to host RAM, checksummed and synced to disk) runs on the engine's cores while
    the next steps compute, and the probe's steps must carry that cost as the sweep's do."""
    takes_value = {s: a.nargs != 0 for a in _serve_parser()._actions for s in a.option_strings}
    tail, out, i = cmd.tail, [], 0
    while i < len(tail):
        tok = tail[i]
        name = tok.split("=", 1)[0]
        if name in PROBE_DROP:
            i += 1 if "=" in tok or not takes_value.get(name, True) else 2
            continue
        out.append(tok)
        i += 1
    return cmd.argv[: cmd.tail_at] + out + ["--port", "{port}", "--step-log", "{workdir}/steps.jsonl"]


def with_step_log(cmd: EngineCommand) -> list[str]:
    """The variant's own command, writing its step log (its EngineConfig is the header)."""
    tail = [t for t in cmd.tail]
    return cmd.argv[: cmd.tail_at] + tail + ["--step-log", "{workdir}/steps.jsonl"]


def _flag(tail: list[str], *names: str) -> str | None:
    for i, tok in enumerate(tail):
        for name in names:
            if tok == name and i + 1 < len(tail):
                return tail[i + 1]
            if tok.startswith(name + "="):
                return tok.split("=", 1)[1]
    return None


def _has(tail: list[str], name: str) -> bool:
    return name in tail


@dataclass
class Policy:
    """A black-box engine's batching limits (what the generic model schedules with)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_tokens: int | None = None  # None: not known (no limit is simulated)
    max_model_len: int | None = None
    prefix_caching: bool = True
    sources: dict[str, str] = field(default_factory=dict)  # setting -> where it came from

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict) -> Policy:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")
BATCHED_LINE = re.compile(r"max_num_batched_tokens=(\d+)")


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def external_policy(cmd: EngineCommand, log_text: str = "") -> Policy:
    """The policy of a black-box engine from its flags and start-up log."""
    t, p = [_fill(x) for x in cmd.tail], Policy()
    if cmd.kind == "vllm":
        p.max_num_seqs, p.max_num_batched_tokens, p.block_size = 128, 2048, 128
        p.sources = {"max_num_seqs": "vLLM's CPU default", "max_num_batched_tokens": "vLLM's CPU default",
                     "block_size": "vLLM's CPU default"}
        for attr, flag in (("max_num_seqs", "--max-num-seqs"), ("max_num_batched_tokens", "--max-num-batched-tokens"),
                           ("block_size", "--block-size"), ("max_model_len", "--max-model-len")):
            v = _int(_flag(t, flag))
            if v:
                setattr(p, attr, v)
                p.sources[attr] = flag
        m = BATCHED_LINE.findall(log_text)
        if m:
            p.max_num_batched_tokens, p.sources["max_num_batched_tokens"] = int(m[-1]), "log"
        kv = KV_LINE.findall(log_text)
        if kv:
            p.kv_tokens, p.sources["kv_tokens"] = int(kv[-1].replace(",", "")), "log"
        p.prefix_caching = not _has(t, "--no-enable-prefix-caching")
    elif cmd.kind == "llamacpp-python":
        n_ctx = _int(_flag(t, "--n_ctx")) or 2048
        p.max_num_seqs, p.max_num_batched_tokens = 1, _int(_flag(t, "--n_batch")) or 512
        p.kv_tokens, p.max_model_len, p.block_size = n_ctx, n_ctx, 16
        p.sources = {"max_num_seqs": "llama-cpp-python serves one request at a time",
                     "max_num_batched_tokens": "--n_batch", "kv_tokens": "--n_ctx"}
    elif cmd.kind == "llama-server":
        n_ctx = _int(_flag(t, "-c", "--ctx-size")) or 4096
        p.max_num_seqs = _int(_flag(t, "-np", "--parallel")) or 4
        p.max_num_batched_tokens = _int(_flag(t, "-b", "--batch-size")) or 2048
        p.kv_tokens, p.max_model_len = n_ctx, n_ctx // p.max_num_seqs
        p.sources = {"max_num_seqs": "-np", "max_num_batched_tokens": "-b", "kv_tokens": "-c"}
    else:
        p.sources = {"max_num_seqs": "unknown (256 assumed)", "max_num_batched_tokens": "unknown (2048 assumed)"}
    return p
