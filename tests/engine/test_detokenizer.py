"""Incremental detokenization equals whole decoding; stop strings are cut, never leaked."""

from __future__ import annotations

from tierguard.engine.detokenizer import IncrementalDetokenizer
from tierguard.model.tokenizer import HFTokenizer


def stream(tok, text: str, stop: list[str]) -> tuple[list[str], bool]:
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("prompt:")
    d = IncrementalDetokenizer(tok, prompt, stop)
    deltas = []
    for t in ids:
        hit = d.add(t)
        deltas.append(d.take(finished=hit))
        if hit:
            return deltas, True
    deltas.append(d.take(finished=True))
    return deltas, False


def test_streamed_text_equals_decode_including_multibyte(tiny_dir):
    tok = HFTokenizer(tiny_dir)
    text = " héllo wörld ✓ caché 東京 done"
    deltas, stopped = stream(tok, text, [])
    assert not stopped and "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_prefix_held_back(tiny_dir):
    tok = HFTokenizer(tiny_dir)
    deltas, stopped = stream(tok, "alpha beta STOP gamma", ["STOP", "never"])
    assert stopped and "".join(deltas) == "alpha beta "
    # Until the stop string completed, no delta contained any part of it.
    assert all("S" not in d for d in deltas)
