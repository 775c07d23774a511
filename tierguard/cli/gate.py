"""`tierguard gate`: an admission-control proxy in front of any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tierguard.common.errors import TierguardError
from tierguard.common.units import parse_bytes, parse_tokens


def _arg(parse, what: str):
    """Wrap a parser so argparse reports its TierguardError as a usage error (exit 2)."""

    def convert(text: str):
        try:
            return parse(text, what)
        except TierguardError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


# flag -> (type, help). Every flag defaults to None so a config file value is kept
# unless the flag is given: defaults < config file < flags.
_POLICY_FLAGS = {
    "max-concurrency": (int, "requests running upstream at once (default 64)"),
    "long-threshold": (_arg(parse_tokens, "--long-threshold"), "input tokens that make a request long (default 8k)"),
    "max-long": (int, "long requests running at once (default 4)"),
    "max-queue": (int, "waiting requests per class (default 64)"),
    "max-queue-wait-ms": (float, "longest wait for a slot; then 429 with Retry-After (default 2000)"),
    "overflow": (str, "when a class queue is full: reject (429), downgrade (trim old chat turns), async (202)"),
    "max-input-tokens": (_arg(parse_tokens, "--max-input-tokens"), "hard input cap; chat over it is trimmed, else 400"),
}
# Slow peers and bounded work per request, shared with `tierguard serve` (docs/hardening.md).
_PEER_FLAGS = {
    "header-timeout-s": (float, "a client must complete its request headers within this; then 408 and the "
                                "connection is closed (default 10)"),
    "body-timeout-s": (float, "a client must send its whole body within this; then 408 (default 10)"),
    "slow-reader-bytes": (_arg(parse_bytes, "--slow-reader-bytes"),
                          "a stream whose client leaves more than this much output unread is ended and its "
                          "slot freed (default 1MiB)"),
    "max-body-bytes": (_arg(parse_bytes, "--max-body-bytes"),
                       "request body limit, e.g. 8MiB (413 above; default: what the longest prompt that fits "
                       "max_model_len can need, see docs/hardening.md)"),
    "tokenizer-workers": (int, "tokenizer worker processes, off the event loop (default 2)"),
    "tokenizer-queue": (int, "tokenizer jobs waiting or running at most; more get 503 + Retry-After (default 32)"),
}
_GATE_FLAGS = {
    "cache-isolation": (str, "prefix-cache isolation between API keys: shared (requests forwarded as they "
                             "came; default) or per-key (a cache_salt per key: keys share no cached prefix "
                             "in any tier, and prefix routing keeps them apart)"),
    "jobs-dir": (str, "directory of async jobs (default $XDG_STATE_HOME/tierguard/jobs, "
                      "i.e. ~/.local/state/tierguard/jobs; created with mode 0700)"),
    "job-ttl-s": (float, "finished async jobs (prompts and answers) are deleted this long after they "
                         "finish (default 86400)"),
    "encrypt-key-file": (str, "AES-256-GCM key file (32 bytes: raw, hex or base64; mode 0600) that encrypts "
                              "async job files; the same kind of file as serve's --kv-encrypt-key-file"),
    "encrypt-old-key-file": (str, "a previous key, for reading jobs written before a key rotation"),
    "max-model-len": (int, "the upstream's context limit (default: from its /v1/models); with --tokenizer "
                           "it refuses prompts that cannot fit before counting them"),
    "async-workers": (int, "async jobs running at once at most (default 4)"),
    "async-max-pending": (int, "async jobs queued or running at most, all keys together: the job queue's "
                               "bound; past it 503 + Retry-After (default 1024)"),
    "async-max-pending-per-key": (int, "async jobs queued or running at most per API key; past it 429 + "
                                       "Retry-After (default 64; without API keys only the total applies)"),
    "async-max-bytes": (_arg(parse_bytes, "--async-max-bytes"),
                        "bytes of async job files on disk at most (bodies and results, until --job-ttl-s "
                        "deletes them), all keys together; past it 503 (default 4GiB)"),
    "async-max-bytes-per-key": (_arg(parse_bytes, "--async-max-bytes-per-key"),
                                "bytes of async job files on disk at most per API key; past it 429 "
                                "(default 512MiB)"),
    "connect-timeout-s": (float, "upstream connect timeout (default 3)"),
    "first-byte-timeout-s": (float, "upstream time to first byte (default 60)"),
    "read-timeout-s": (float, "longest upstream silence mid-stream (default 60)"),
    "total-timeout-s": (float, "whole upstream request (default 600)"),
    "upstream-pool": (int, "connections kept to the upstream (default 1024)"),
}


# Several upstreams, how requests are spread over them, and limits shared with other gates
# (docs/fleet.md).
_FLEET_FLAGS = {
    "route": (str, "how requests are spread over several --upstream: prefix (the replica that likely holds "
                   "the prompt's prefix, minus beta x its relative load; sessions stick), least-loaded, "
                   "round-robin (default prefix)"),
    "route-beta": (float, "prefix routing: weight of relative load against matched prefix share (default 0.5)"),
    "route-imbalance": (int, "prefix routing: a replica this many requests above the least loaded one gets "
                             "no prefix or session traffic (default 8)"),
    "route-index-entries": (int, "prefix routing: text chunks remembered, all replicas together, LRU "
                                 "(default 65536, a few MiB)"),
    "health-interval-s": (float, "seconds between /health probes and /metrics scrapes of each upstream "
                                 "(default 1)"),
    "eject-after": (int, "consecutive timeouts or 502/504 that eject an upstream; a refused connection "
                         "ejects at once (default 3)"),
    "shared-state": (str, "redis://[[USER]:PASSWORD@]HOST:PORT[/DB] (rediss:// for TLS), or "
                          "redis+cluster://HOST:PORT[,HOST:PORT...] for a Redis Cluster (docs/fleet.md): "
                          "--max-concurrency, --max-long and the queues become global across every gate "
                          "naming the same Redis (slots are leases, all in one cluster slot)"),
    "shared-prefix": (str, "Redis key prefix; one per fleet of gates (default tierguard:gate)"),
    "lease-ms": (int, "a slot of a gate that stops renewing it (killed) is free again after this "
                      "(default 5000)"),
    "shared-timeout-ms": (float, "a Redis call slower than this counts as Redis down: limits fall back to "
                                 "this gate's share (default 100)"),
    "shared-gates": (int, "gates to assume at least when dividing the limits while Redis is down "
                          "(default 1; the number last seen alive in Redis when larger)"),
}

# Admission by predicted TTFT instead of the static limits (docs/fleet.md).
_PREDICTED_FLAGS = {
    "ttft-slo-ms": (str, "predicted admission: the TTFT SLO of each class, e.g. interactive=1000,batch=20000 "
                         "(the defaults)"),
    "ttft-chunk-tokens": (int, "predicted admission: the engine's tokens per step (its max_num_batched_tokens) "
                               "where no calibration file says (default 1024)"),
    "ttft-online": (str, "predicted admission: on (default) keeps learning each upstream's costs from its "
                         "answers; off keeps the calibration's"),
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gate", help="admission-control proxy: bounded queues, long-session limits, async jobs",
                              description=__doc__)
    p.add_argument("--upstream", action="append",
                   help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000; repeat it "
                        "for several replicas (see --route)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8080; 0 picks a free one)")
    p.add_argument("--config", help="TOML or YAML file with the same options as the flags (flags win)")
    p.add_argument("--tokenizer", help="local directory with tokenizer.json (default: upstream /tokenize, else estimate)")
    p.add_argument("--api-key", help="key clients must send as 'Authorization: Bearer KEY' (or TIERGUARD_API_KEY)")
    p.add_argument("--api-key-file", help="file with one client key per line; mode 0600 (a file group or others "
                                          "can read is refused, as for --encrypt-key-file)")
    p.add_argument("--upstream-api-key", help="key sent to the upstream (or TIERGUARD_UPSTREAM_API_KEY)")
    p.add_argument("--log", help="JSONL request log file")
    p.add_argument("--log-prompts", action="store_true", default=None, help="include prompt text in the log")
    p.add_argument("--exact-token-count", action="store_true", default=None,
                   help="count every request's input with the tokenizer; by default a request whose UTF-8 "
                        "byte count (+ template slack) is already below the long threshold and the input cap "
                        "is admitted as short without a count (valid for tokenizers that emit at least one "
                        "byte per token: byte-level BPE, SentencePiece with byte fallback)")
    p.add_argument("--route-headers", action="store_true", default=None,
                   help="send X-Tierguard-Replica and X-Tierguard-Route on responses (they tell a client whether "
                        "another one sent the same opening text: only when every client is trusted)")
    add_policy_flags(p, ("reject", "downgrade", "async"))
    for flag, (kind, text) in _GATE_FLAGS.items():
        p.add_argument("--" + flag, type=kind, help=text)
    add_peer_flags(p)
    fleet = p.add_argument_group("several upstreams and limits shared between gates")
    for flag, (kind, text) in _FLEET_FLAGS.items():
        fleet.add_argument("--" + flag, type=kind, help=text)
    predicted = p.add_argument_group("admission by predicted TTFT")
    predicted.add_argument("--admission", choices=("static", "predicted"),
                           help="static (default): --max-concurrency and --max-queue decide; predicted: a request "
                                "is admitted when the TTFT it would see is within its class's --ttft-slo-ms, else "
                                "told --overflow's answer at once (429 with Retry-After = the predicted wait)")
    predicted.add_argument("--ttft-calibration", action="append",
                           help="predicted admission: a `tierguard predict` calibration file for every upstream, "
                                "or N=FILE / URL=FILE for one (repeat it); without one the costs are learned "
                                "from the upstream's answers")
    for flag, (kind, text) in _PREDICTED_FLAGS.items():
        predicted.add_argument("--" + flag, type=kind, help=text)
    p.add_argument("--verbose", "-v", action="store_true", help="log every decision")
    return p


def add_policy_flags(p: argparse.ArgumentParser, overflow_choices: tuple[str, ...]) -> None:
    """The admission-policy flags, shared by `tierguard gate` and `tierguard serve`."""
    group = p.add_argument_group("admission control (R8)")
    for flag, (kind, text) in _POLICY_FLAGS.items():
        choices = overflow_choices if flag == "overflow" else None
        group.add_argument("--" + flag, type=kind, help=text, choices=choices)


def add_peer_flags(p: argparse.ArgumentParser) -> None:
    """Slow-peer and body/tokenizer limits, shared by `tierguard gate` and `tierguard serve`."""
    group = p.add_argument_group("slow peers and bounded work per request")
    for flag, (kind, text) in _PEER_FLAGS.items():
        group.add_argument("--" + flag, type=kind, help=text)


def _normalize_sizes(options: dict) -> None:
    for key in ("long_threshold", "max_input_tokens"):
        if isinstance(options.get(key), str):
            options[key] = parse_tokens(options[key], key)


def policy_from_args(args: argparse.Namespace, config: str | None):
    """An AdmissionPolicy from a policy file overlaid by the flags, or None when neither is given."""
    from tierguard.gate.policy import POLICY_KEYS, AdmissionPolicy, load_config

    options = load_config(config) if config else {}
    other = sorted(set(options) - POLICY_KEYS)
    if other:
        raise TierguardError(f"config file {config!r}: only admission options belong here, not {', '.join(other)}")
    _normalize_sizes(options)
    for flag in _POLICY_FLAGS:
        value = getattr(args, flag.replace("-", "_"), None)
        if value is not None:
            options[flag.replace("-", "_")] = value
    return AdmissionPolicy(**options).validate() if options else None


def resolve_options(args: argparse.Namespace) -> dict:
    """Config file values overlaid by the flags that were given."""
    from tierguard.gate.policy import load_config

    options = load_config(args.config) if args.config else {}
    for key in ("api_key", "upstream_api_key"):
        if isinstance(options.get(key), str) and options[key]:
            raise TierguardError(f"config file holds {key}; keep secrets out of config files "
                                 f"(use --api-key-file or TIERGUARD_{key.upper()})")
    _normalize_sizes(options)
    for key in ("max_body_bytes", "slow_reader_bytes", "async_max_bytes", "async_max_bytes_per_key"):
        if isinstance(options.get(key), str):
            options[key] = parse_bytes(options[key], key)
    for name in ("upstream", "host", "port", "tokenizer", "api_key", "api_key_file", "upstream_api_key", "log",
                 "log_prompts", "exact_token_count", "route_headers", "admission", "ttft_calibration",
                 *(f.replace("-", "_") for f in {**_POLICY_FLAGS, **_GATE_FLAGS, **_PEER_FLAGS, **_FLEET_FLAGS,
                                                 **_PREDICTED_FLAGS})):
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    options.setdefault("api_key", os.environ.get("TIERGUARD_API_KEY") or None)
    options.setdefault("upstream_api_key", os.environ.get("TIERGUARD_UPSTREAM_API_KEY") or None)
    if not options.get("upstream"):
        raise TierguardError("--upstream URL is required (or 'upstream' in the config file)")
    return options


def run(args: argparse.Namespace) -> int:
    import asyncio

    from tierguard.gate.app import serve
    from tierguard.gate.policy import build_settings

    settings = build_settings(resolve_options(args))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tierguard.gate").setLevel(logging.INFO)  # start-up facts are always shown
    if not args.verbose:
        logging.getLogger("tierguard.gate").addFilter(lambda r: not r.getMessage().startswith("/v1/"))

    def ready(port: int) -> None:
        print(f"READY {port}", flush=True)

    try:
        import uvloop  # a C event loop: less CPU per relayed chunk than asyncio's Python loop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    logging.getLogger("tierguard.gate").info("event loop: %s", "uvloop" if loop_factory else "asyncio")
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(settings, on_ready=ready))
    except OSError as exc:
        raise TierguardError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None
    return 0
