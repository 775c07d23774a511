"""The product speaks of itself: no words about how it was made.

README, docs, the package (code, kernels, data files), the benches and the tests state what
tierguard does and why. A reader who clones the repository cannot resolve a commit hash in
prose, a tracker's issue number, "this VM" or a path on the machine it was written on, so
such words fail this test. Figures belong in docs/benchmarks.md (command, machine, date);
the before and after of a change belongs in its commit message.

Each rule is a regex aimed at one kind of phrase, narrow enough that code does not trip it
(hex constants, hashes in fixtures, "here" meaning a place in the code). A hit is reported
as file:line, the rule and the phrase.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()

# What is scanned: (folder or file, suffixes; None for every file).
SCOPE: list[tuple[str, tuple[str, ...] | None]] = [
    ("README.md", None),
    ("docs", (".md",)),
    ("tierguard", (".py", ".c", ".h", ".inc", ".json", ".yaml", ".yml", ".toml", ".md")),
    ("bench", (".py", ".sh", ".md", ".yaml", ".json")),
    ("tests", (".py", ".md", ".yaml", ".json")),
]

# A commit-hash-like token: 7-40 lowercase hex characters with at least one digit and one
# letter, right after "at " or "(": "at 62402f9", "(104caa4)". Hex constants ("0x1f...")
# and hashes inside paths or URLs are not preceded by either.
_HASH = r"(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"

# Words may be split across a line break (prose is wrapped), so rules match the whole text
# with \s+ between words, and a hit is reported at the line where it starts.
RULES: dict[str, re.Pattern[str]] = {
    "commit hash": re.compile(r"(?:\bat\s+|\()" + _HASH),
    "issue number": re.compile(r"\bissues?\s+\d+\b", re.I),  # "issue #123" of another project is fine
    "this stop": re.compile(r"\bthis\s+stop\b", re.I),
    "this VM": re.compile(r"\bthis\s+(?:\w+\s+)?VM\b", re.I),
    # "(6 GB RSS seen here)", "(50.0 here)", "not measured here": a figure from the author's
    # machine. "(an encrypting codec goes here)" is a place in the code and stays.
    "measured here": re.compile(r"\([^()\n]*\d[^()\n]*\bhere\)|\b(?:seen|measured|observed)\s+here\b", re.I),
    "machine path": re.compile(r"(?<![\w.])/work/|\bshared/reference\b|(?<![\w.])/tmp/i\d+\b"),
    "run history": re.compile(r"\b(?:every|all|each)\s+runs?\s+so\s+far\b|\bearlier\s+runs\b", re.I),
    "how it was found": re.compile(
        r"\bthe\s+code\s+index\b|\bthe\s+index\s+names\s+no\b|\bfor\s+this\s+work\b", re.I
    ),
}

# Narrow, reasoned exemptions: (path relative to ROOT, rule, text the hit must contain).
EXEMPT: list[tuple[str, str, str]] = []


def _files() -> list[Path]:
    out: list[Path] = []
    for rel, suffixes in SCOPE:
        base = ROOT / rel
        if base.is_file():
            out.append(base)
            continue
        for p in sorted(base.rglob("*")):
            if not p.is_file() or p.resolve() == SELF or "__pycache__" in p.parts:
                continue
            if suffixes is None or p.suffix in suffixes:
                out.append(p)
    return out


def find_hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, rule, phrase) for every match of a rule in `text`, in line order."""
    hits = []
    for name, rx in RULES.items():
        for m in rx.finditer(text):
            hits.append((text.count("\n", 0, m.start()) + 1, name, " ".join(m.group(0).split())))
    return sorted(hits)


def _exempt(rel: str, rule: str, line: str) -> bool:
    return any(rel == p and rule == r and s in line for p, r, s in EXEMPT)


def test_the_product_speaks_of_itself():
    found = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        lines = text.splitlines()
        for n, rule, phrase in find_hits(text):
            if not _exempt(rel, rule, lines[n - 1]):
                found.append(f"{rel}:{n}: [{rule}] {phrase!r}")
    assert not found, "words about how tierguard was made (see tests/test_wording.py):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "before this stop's attention kernel",
        "in every run so far",
        "the six-server bench at 27547ee",
        "all at `--itl-slo-ms 33` (104caa4)",
        "Runs on this VM move by 20-40 %",
        "(100 ms timeout on this loaded VM)",
        "(issue 11; `python -m tierguard.engine.speed`)",
        "used to calibrate `tierguard plan` (issue 14).",
        "Issue 15's must-show.",
        "the server grew by gigabytes (6 GB RSS seen here).",
        "encrypt_into = getattr(s, 'encrypt_into', None)  # recent cryptography (50.0 here)",
        "# CUDA keeps whole chunks (not measured here).",
        "compares two logs from `/work/shared/reference`",
        "public code found through the code index (ids 57378510725)",
        "the index names no repository for them",
        "configs added for this work carry a `_source`",
        "entry with the run's architecture; configs added for this\nwork carry a `_source`.",
        "Boundaries move (the run before\nthis one, before this stop's attention kernel)",
        "Earlier runs, on 2 Zen 3 vCPUs",
        "start what it lacks (here with `HOME=/tmp/i15/home`)",
    ],
)
def test_each_listed_phrase_is_caught(text):
    assert find_hits(text), text


@pytest.mark.parametrize(
    "text",
    [
        "codec: BlockCodec = IDENTITY  # an encrypting codec goes here)",
        "56      8     xxh3-64 of bytes 0..55 (a torn header fails here)",
        "#define TG_MAGIC 0x5447cafe1234",
        "_source: github.com/rasbt/LLMs-from-scratch @0405b0c8e7b16b870cbcf5f84908e14c2d177bcf",
        "vllm-project/vllm issue #21348 (excluded)",
        "from /var/lib/tierguard/kv/a1b2c3d4e5f60718; kept 15",
        "self.text = ''  # all output text so far",
        "shutil.rmtree(scratch)  # spilled blocks of an earlier run are scratch",
        "tierguard plan --model /tmp/gemma3-27b --context 32k",
        "at 1024 tokens (deadbeef) at abcdefabc",
    ],
)
def test_code_and_product_words_pass(text):
    assert not find_hits(text), find_hits(text)
