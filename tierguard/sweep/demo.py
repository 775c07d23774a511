"""The demo matrix: read from data/demo.yaml, trimmed to what this build can run.

Why a data file: variants are added by editing YAML, not code. A variant may list the
`tierguard serve` flags it `requires`; variants whose flags this build lacks are left
out and reported, so the demo always runs on what exists.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from tierguard.sweep.matrix import Matrix, parse_matrix


@dataclass
class DemoMatrix:
    matrix: Matrix
    skipped: dict[str, list[str]] = field(default_factory=dict)  # variant -> missing flags


def demo_document() -> dict[str, Any]:
    text = resources.files("tierguard.sweep").joinpath("data/demo.yaml").read_text()
    return yaml.safe_load(text)


def serve_flags() -> set[str]:
    """Option strings `tierguard serve` accepts in this build (without starting anything)."""
    import argparse

    from tierguard.cli import serve

    sub = argparse.ArgumentParser().add_subparsers()
    parser = serve.add_parser(sub)
    return {s for a in parser._actions for s in a.option_strings}


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_demo_matrix(
    quick: bool = False, available: set[str] | None = None, doc: dict[str, Any] | None = None
) -> DemoMatrix:
    doc = doc if doc is not None else demo_document()
    flags = available if available is not None else serve_flags()
    m = copy.deepcopy(doc["matrix"])
    if quick:
        q = dict(doc.get("quick") or {})
        keep = q.pop("variants", None)
        m = _merge(m, q)
        if keep is not None:
            m["variants"] = [v for v in m["variants"] if v["name"] in keep]
    skipped: dict[str, list[str]] = {}
    variants = []
    for v in m["variants"]:
        missing = [f for f in v.pop("requires", []) if f not in flags]
        if missing:
            skipped[v["name"]] = missing
        else:
            variants.append(v)
    m["variants"] = variants
    kept = {v["name"] for v in variants}
    for v in variants:
        if "bounded_by" in v:
            v["bounded_by"] = [n for n in v["bounded_by"] if n in kept]
    if quick:
        m["name"] = m.get("name", "tierguard-demo") + "-quick"
    return DemoMatrix(parse_matrix(m, "demo matrix"), skipped)
