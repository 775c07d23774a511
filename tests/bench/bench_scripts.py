"""The bench/ scripts as modules for the tests: a script imports its neighbours
(`validity`, `tier_common`, `goodput`) by bare name, so bench/ is on sys.path while one
is imported, and taken off again so no other test sees it."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextlib.contextmanager
def on_path() -> Iterator[None]:
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))


def bench_module(name: str):
    """bench/NAME.py imported under its own name (one module object per process)."""
    with on_path():
        return importlib.import_module(name)


def fresh_bench_module(name: str):
    """bench/NAME.py executed anew as `bench_NAME` (its module-level state its own)."""
    with on_path():
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
