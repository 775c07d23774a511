"""The inputs of `tierguard kvcheck`: a long real text, and passkey prompts.

Perplexity text: Debian's license texts under /usr/share/common-licenses (every
Debian/Ubuntu machine has them), concatenated in a fixed order, so the numbers compare
across machines without the project shipping a corpus. `--text FILE` replaces it.

Passkey (Mohtashami & Jaggi's retrieval test): a 5-digit key hidden at a depth in
repetitive filler, asked for at the end. A 135M model finds it in filler; in real prose
it mostly continues the prose, so the haystack is filler. A trial's prompt, as token
ids (pieces tokenized separately, so lengths are exact and the shared prefix is
token-identical across trials):

    head (chat template + instruction) | filler[:k] | needle | filler[k:m] | question + "The pass key is"

with k at the trial's depth and m chosen so the whole prompt is `context` tokens. The
runner prefills head + filler once per KV dtype, so every trial computes only from its
needle onwards.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tierguard.common.errors import TierguardError
from tierguard.common.units import parse_token_list

BASELINE = "auto"  # the engine's unquantized pool (the model dtype)
ANSWER_TOKENS = 10  # greedy tokens generated per passkey trial
LICENSE_DIR = Path("/usr/share/common-licenses")
LICENSE_ORDER = ("GPL-3", "Apache-2.0", "MPL-2.0", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-1.1", "Artistic")

INSTRUCTION = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key."
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."


@dataclass
class TextSource:
    name: str  # what the JSON says the text is
    files: list[str]
    text: str


def load_text(path: str | None = None) -> TextSource:
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise TierguardError(f"--text {path!r} is not a file")
        return TextSource(p.name, [str(p)], p.read_text(encoding="utf-8", errors="replace"))
    files = [LICENSE_DIR / n for n in LICENSE_ORDER if (LICENSE_DIR / n).is_file()]
    if not files:
        raise TierguardError(
            f"no license texts under {LICENSE_DIR} (Debian package base-files); pass a long text with --text FILE"
        )
    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return TextSource("debian-common-licenses", [str(f) for f in files], text)


def parse_contexts(text: str) -> list[int]:
    contexts = sorted(set(parse_token_list(text, "--contexts")))
    if not contexts or contexts[0] < 128:
        raise TierguardError(f"--contexts must be at least 128 tokens each, got {text!r}")
    return contexts


@dataclass
class Trial:
    context: int
    index: int
    depth: float  # where the needle sits, as a share of the haystack
    key: str
    prompt: list[int]


class PromptBuilder:
    """Token ids for the teacher-forced text and the passkey trials, from one tokenizer."""

    def __init__(self, tokenizer, text: str, max_context: int) -> None:
        self.tok = tokenizer
        if getattr(tokenizer, "chat_template", None):
            before, after = tokenizer.apply_chat_template([{"role": "user", "content": "@@"}]).split("@@", 1)
            self.head = tokenizer.encode(before + INSTRUCTION + "\n", add_special_tokens=False)
            self.tail = tokenizer.encode("\n" + QUESTION + after + ANSWER_PREFIX, add_special_tokens=False)
        else:
            self.head = tokenizer.encode(INSTRUCTION + "\n")
            self.tail = tokenizer.encode("\n" + QUESTION + "\n" + ANSWER_PREFIX, add_special_tokens=False)
        unit = tokenizer.encode(FILLER, add_special_tokens=False)
        self.filler = unit * (max_context // max(1, len(unit)) + 1)
        self.text = tokenizer.encode(text, add_special_tokens=False)
        self.bos = tokenizer.encode("", add_special_tokens=True)  # [BOS] when the tokenizer adds one
        if len(self.bos) + len(self.text) < max_context:
            raise TierguardError(
                f"the text has {len(self.text)} tokens; the longest context asks for {max_context}"
            )

    def teacher_ids(self, length: int) -> list[int]:
        """The perplexity text, `length` tokens (BOS first when the tokenizer adds one)."""
        return (self.bos + self.text)[:length]

    def haystack_ids(self, length: int) -> list[int]:
        """head + filler: the prefix every trial shares up to its needle (prefilled once)."""
        return (self.head + self.filler)[:length]

    def trials(self, context: int, n: int, seed: int, answer_tokens: int = 10) -> list[Trial]:
        """`n` trials at `context` tokens: 5-digit keys from a seeded RNG, depths spread
        evenly over the haystack (stratified, jittered within each stratum)."""
        rng = random.Random(f"{seed}-{context}")
        out = []
        for i in range(n):
            key = str(rng.randint(10000, 99999))
            needle = self.tok.encode(NEEDLE.format(key=key), add_special_tokens=False)
            # prompt + answer = context tokens
            room = context - answer_tokens - len(self.head) - len(needle) - len(self.tail)
            if room < 16:
                raise TierguardError(f"context {context} is too short for the passkey prompt")
            depth = (i + rng.random()) / n
            k = int(depth * room)
            prompt = self.head + self.filler[:k] + needle + self.filler[k:room] + self.tail
            out.append(Trial(context, i, round(depth, 4), key, prompt))
        return out


def answer_correct(text: str, key: str) -> bool:
    """The first run of digits in the answer must be the key."""
    digits = ""
    for ch in text:
        if ch.isdigit():
            digits += ch
        elif digits:
            break
    return digits == key
