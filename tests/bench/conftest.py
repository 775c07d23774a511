"""Fixtures: misbehaving servers in a background thread, a tiny local tokenizer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import pytest
from aiohttp import web


@contextlib.contextmanager
def serve_app(app: web.Application):
    """Run an aiohttp app on 127.0.0.1:<ephemeral> in a thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    ready = threading.Event()
    box: dict = {}

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["port"] = site._server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    t = threading.Thread(target=main, daemon=True)
    t.start()
    ready.wait(10)
    try:
        yield f"http://127.0.0.1:{box['port']}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def word_tokenizer(tmp_path):
    """A whitespace word-level tokenizer saved as tokenizer.json (no hub download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["tok", "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by",
             "at", "from", "his", "her", "an", "are"] + [f"w{i}" for i in range(80)]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[UNK]"])
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return str(d)


@pytest.fixture(name="serve_app")
def _serve_app_fixture():
    return serve_app


@pytest.fixture(name="free_port")
def _free_port_fixture():
    return free_port
