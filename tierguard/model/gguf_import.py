"""`tierguard model import-gguf`: a GGUF file -> a Hugging Face directory the engine loads.

Writes model.safetensors (dequantized to --dtype), config.json, generation_config.json,
tokenizer.json and tokenizer_config.json (chat template included). Everything is checked
before the first byte is written (architecture, tensor names and types, tokenizer), the
output is built in a temporary sibling directory and renamed into place at the end, so
a failed import leaves nothing half-written. Tensors are dequantized and written one at
a time: peak memory is one tensor, not the model (bench/gguf_import_rss.py measures it).

`cached_import` imports a file once into $TIERGUARD_CACHE/models, keyed by the file's
content hash, so `--model FILE.gguf` costs the import only the first time.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tierguard.common.errors import TierguardError
from tierguard.model import gguf_reader as gr
from tierguard.model.config import ModelConfig
from tierguard.model.gguf_tokenizer import build_tokenizer
from tierguard.model.st_writer import DTYPES, StreamingSafetensors

# Bump when the output of import_gguf changes, so cached imports are rebuilt.
IMPORT_FORMAT_VERSION = 1


@dataclass
class GGUFImport:
    path: Path
    architecture: str
    tensors: int
    dtype: str
    tensor_types: dict[str, int]  # GGUF type name -> count
    seconds: float
    bytes_written: int


def file_hash(path: str | Path) -> str:
    """xxh3-128 of the file's bytes (fast enough to run on every `--model FILE.gguf`)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> GGUFImport:
    if dtype not in DTYPES:
        raise TierguardError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    t0 = time.perf_counter()
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TierguardError(f"output {str(out)!r} exists and is not an empty directory")
    reader = gr.open_gguf(gguf_path)
    config = gr.hf_config(reader, dtype)
    ModelConfig.from_dict(config)  # the engine must be able to run it
    planned = gr.plan_tensors(reader)
    tokenizer, tok_config = build_tokenizer(reader)
    permuted = gr.ARCHITECTURES[gr.architecture(reader)][2]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.import-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
    try:
        writer = StreamingSafetensors(
            tmp / "model.safetensors", [(name, gr.hf_shape(t)) for name, t in planned], dtype
        )
        try:
            for name, tensor in planned:
                writer.add(name, gr.dequantize(tensor, config, permuted))
        except BaseException:
            writer.abort()
            raise
        writer.close()
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tok_config)
        _write_json(tmp / "config.json", config)
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        _write_json(tmp / "generation_config.json", gen)
        _write_json(
            tmp / "gguf_source.json",
            {"file": Path(gguf_path).name, "format_version": IMPORT_FORMAT_VERSION, "dtype": dtype},
        )
        if out.exists():
            out.rmdir()  # empty (checked above); rename cannot replace it otherwise on every OS
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    types: dict[str, int] = {}
    for _, t in planned:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return GGUFImport(
        path=out,
        architecture=config["architectures"][0],
        tensors=len(planned),
        dtype=dtype,
        tensor_types=types,
        seconds=time.perf_counter() - t0,
        bytes_written=sum(f.stat().st_size for f in out.iterdir()),
    )


def cached_import(gguf_path: str | Path, dtype: str = "float32", cache_dir: str | Path | None = None) -> Path:
    """The imported directory for `gguf_path`, importing it on first use.

    Safe against concurrent importers: each imports into its own temp dir and renames it
    into place; the loser of the race discards its copy.
    """
    from tierguard.model.tiny import cache_root

    path = Path(gguf_path)
    if not path.is_file():
        raise TierguardError(f"GGUF file {str(path)!r} does not exist")
    root = Path(cache_dir) if cache_dir else cache_root()
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:60]
    final = root / "models" / f"gguf-v{IMPORT_FORMAT_VERSION}-{stem}-{file_hash(path)[:16]}-{dtype}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gguf-", dir=final.parent))
    try:
        import_gguf(path, staging / "model", dtype)
        try:
            os.rename(staging / "model", final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
