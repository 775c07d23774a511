"""Where `--model` comes from: a config.json path, a directory, or a catalogue name.

The built-in catalogue ships as package data (data/model_configs.json). Users add
their own configs with `--model-dir DIR` (or TIERGUARD_MODEL_DIRS, colon-separated):
every `*.json` file there, or `<sub>/config.json`, is a model named by its file or folder.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from tierguard.common.errors import TierguardError
from tierguard.plan.config import ModelSpec, parse_config


def builtin_configs() -> dict[str, dict]:
    """Name -> raw config of the shipped catalogue."""
    text = resources.files("tierguard.plan").joinpath("data/model_configs.json").read_text(encoding="utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise TierguardError(f"cannot read model config {str(path)!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise TierguardError(
            f"model config {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from None
    if not isinstance(data, dict):
        raise TierguardError(f"model config {str(path)!r} is not a JSON object")
    return data


def _user_dirs(extra: list[str] | None) -> list[Path]:
    dirs = [Path(d) for d in (extra or [])]
    env = os.environ.get("TIERGUARD_MODEL_DIRS", "")
    dirs += [Path(d) for d in env.split(os.pathsep) if d]
    return dirs


def user_configs(extra_dirs: list[str] | None = None) -> dict[str, Path]:
    """Name -> path of configs in user directories."""
    found: dict[str, Path] = {}
    for d in _user_dirs(extra_dirs):
        if not d.is_dir():
            raise TierguardError(f"model directory {str(d)!r} does not exist")
        for p in sorted(d.glob("*.json")):
            found[p.stem] = p
        for p in sorted(d.glob("*/config.json")):
            found[p.parent.name] = p
    return found


def _lookup(name: str, table: dict) -> str | None:
    """Exact name, else a unique case-insensitive match on the full or short name."""
    if name in table:
        return name
    low = name.lower()
    hits = [k for k in table if k.lower() == low or k.lower().split("/")[-1] == low]
    return hits[0] if len(hits) == 1 else None


def load_model(model: str, extra_dirs: list[str] | None = None) -> ModelSpec:
    """Resolve `--model` to a ModelSpec; a path wins over a catalogue name."""
    if not model or not str(model).strip():
        raise TierguardError(
            "--model is required: a config.json path, a directory holding one, or a catalogue name"
        )
    from tierguard.model.registry import imported_model_dir  # 'smollm2' and .gguf files

    path = imported_model_dir(model) or Path(model).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise TierguardError(f"directory {model!r} holds no config.json")
        return parse_config(_read_json(cfg), name=path.name)
    if path.is_file():
        return parse_config(
            _read_json(path), name=path.stem if path.name != "config.json" else path.parent.name
        )
    users = user_configs(extra_dirs)
    key = _lookup(model, users)
    if key is not None:
        return parse_config(_read_json(users[key]), name=key)
    builtin = builtin_configs()
    key = _lookup(model, builtin)
    if key is not None:
        return parse_config(builtin[key], name=key)
    raise TierguardError(
        f"unknown model {model!r}: not a file or directory, and not in the catalogue "
        f"({', '.join(sorted(builtin))}; add your own with --model-dir)"
    )
