"""Prompts of exact token length, from the best token counter available.

Order of preference: the model's tokenizer from a local directory (`tokenizer.json`,
loaded with the `tokenizers` library — exact), the server's `/tokenize` endpoint (exact
for that server), else an approximation of one token per common English word (marked
`exact=False` in run.json, because lengths are then only estimates).

A prompt is built from "units" (token ids, or words), rendered to text, counted, and the
tail adjusted until the count matches: BPE merges at unit boundaries can change the
count, so rendering alone is not enough.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from tierguard.common.errors import TierguardError

# Short common words; in GPT-2/Llama/Qwen vocabularies each is one token with its space.
WORDS = (
    "the of and to in is was for on that with as by at from his her an are were be this "
    "which or had not but have its one all they their been has more who when new time first "
    "after also two other some into most year over only may such these then city used world "
    "part made many where would people state school both well during known later work film "
    "music game team river house found three until each early between while under called "
    "since end life great small local long good line high west east north south war area"
).split()


def file_sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


class PromptMaker:
    """Builds texts of an exact token count. Subclasses define units and counting."""

    exact = False
    source = "approximate"
    identity: dict = {}

    def random_units(self, n: int, rng: np.random.Generator) -> list:
        return [WORDS[i] for i in rng.integers(0, len(WORDS), size=n)]

    def render(self, units: list) -> str:
        return " " + " ".join(units)

    def count(self, text: str) -> int:
        return len(text.split())

    def text_of_length(self, n: int, rng: np.random.Generator, head: list | None = None) -> tuple[str, list]:
        """Text whose count is `n`; `head` units (a shared prefix or history) are kept as-is."""
        head = list(head or [])
        units = head + self.random_units(max(0, n - len(head)), rng)
        for _ in range(12):
            text = self.render(units)
            c = self.count(text)
            if c == n:
                return text, units
            if c > n and len(units) > len(head):
                units = units[: max(len(head), len(units) - (c - n))]
            elif c < n:
                units = units + self.random_units(n - c, rng)
            else:
                break
        return self.render(units), units  # closest we got; counted again by the caller


class TokenizerPrompts(PromptMaker):
    """Exact lengths with the model's own tokenizer (`tokenizer.json` in a local dir)."""

    exact = True

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer

        from tierguard.model.registry import resolve_tokenizer  # 'smollm2', 'tiny', FILE.gguf

        d = Path(resolve_tokenizer(directory))
        path = d / "tokenizer.json" if d.is_dir() else d
        if not path.is_file():
            raise TierguardError(f"--tokenizer {directory!r}: no tokenizer.json found there")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise TierguardError(f"--tokenizer {directory!r}: cannot load {path.name}: {exc}") from None
        files = [p for p in path.parent.glob("tokenizer*") if p.is_file()]
        self.identity = {"path": str(path.parent), "files": sorted(p.name for p in files), "sha256": file_sha256(files)}
        self.source = f"tokenizer:{self.identity['sha256'][:12]}"
        vocab = self.tok.get_vocab()
        word = re.compile(r"^(Ġ|▁)[a-z]{2,8}$")
        ids = sorted(i for t, i in vocab.items() if word.match(t))
        if len(ids) < 64:  # unusual vocabularies: any token that is not special or markup
            special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
            ids = sorted(i for t, i in vocab.items() if i not in special and t.isalnum())
        self.unit_ids = np.asarray(ids)

    def random_units(self, n: int, rng: np.random.Generator) -> list:
        return [int(i) for i in self.unit_ids[rng.integers(0, len(self.unit_ids), size=n)]]

    def render(self, units: list) -> str:
        return self.tok.decode(units, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def chunk_token_counts(self, texts: list[str]) -> list[int]:
        """Tokens per streamed chunk: tokenize the whole text once, assign each token to
        the chunk where it starts (tokenizing chunks one by one would miscount merges)."""
        full = "".join(texts)
        enc = self.tok.encode(full, add_special_tokens=False)
        bounds = np.cumsum([len(t) for t in texts])
        counts = [0] * len(texts)
        for start, _ in enc.offsets:
            counts[min(int(np.searchsorted(bounds, start, side="right")), len(texts) - 1)] += 1
        return counts


class ServerPrompts(PromptMaker):
    """Exact lengths for this server, counted by its `/tokenize` endpoint."""

    exact = True
    source = "server:/tokenize"

    def __init__(self, base_url: str, model: str | None, headers: dict[str, str]) -> None:
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model, self.headers = model, headers
        self.count(" the")  # raises when the endpoint is missing

    def count(self, text: str) -> int:
        body = json.dumps({"model": self.model, "prompt": text, "add_special_tokens": False}).encode()
        req = urllib.request.Request(self.url, data=body, headers={**self.headers, "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            data = json.loads(resp.read())
        if "count" in data:
            return int(data["count"])
        return len(data["tokens"])


def make_prompt_maker(tokenizer: str | None, base_url: str, model: str | None, headers: dict[str, str]) -> PromptMaker:
    if tokenizer:
        return TokenizerPrompts(tokenizer)
    try:
        return ServerPrompts(base_url, model, headers)
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        return PromptMaker()
