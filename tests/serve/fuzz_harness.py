"""Fuzzing the HTTP edges: `tierguard serve` (real tiny engine) and a gate in front of it.

Both servers run in one background event loop on loopback sockets, through the same
guarded runners the CLI uses. Requests are written as raw bytes on a plain socket, so
nothing a client library would refuse to send (odd headers, wrong lengths, byte noise)
is filtered out before it reaches the server. `Fuzz.send` returns what came back;
`check` says whether it is a well-formed answer: a 2xx/4xx JSON body with the OpenAI
error shape, an SSE stream that ends with [DONE], or, for bytes that are not HTTP at
all, aiohttp's plain 400 or a closed connection. Never a 5xx; and every log record at
ERROR (or with a traceback) from any logger is collected in `Fuzz.bad_logs`.

The engine is fuzzed too, not only the HTTP parsing: "engine" cases are requests that
pass parsing with sampling fields at their extremes (int64 and vocabulary edges and far
beyond, NaN and Infinity, long stop lists, stop_token_ids out of range, absurd
max_tokens), and `run_case` sends a plain request straight to serve after every case:
the case that leaves the engine unable to serve it is reported (`Fuzz.killer`). Requests
known to stop an engine without its checks (`KILLERS`) are sent first in every run.

Used by tests/serve/test_fuzz_http.py (200 mixed and 30 engine cases by default, 5,000 in the slow test) and
by bench/fuzz_http.py (prints the counts as JSON).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import strategies as st

SERVE_KEY = "sk-serve-fuzz"
GATE_KEY = "sk-gate-fuzz"
MAX_MODEL_LEN = 64  # every generation the fuzz can start ends within a few dozen tokens
NO_ANSWER = "no answer within"
VOCAB = 4096  # the tiny model's (checked at start): the edges the engine cases draw around
SERVE_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
GATE_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/async/completions", "/v1/async/chat/completions"]


@dataclass
class Answer:
    status: int | None  # None: the connection closed without a response
    content_type: str = ""
    body: bytes = b""
    error: str = ""


class _BadLogs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(f"{record.name}: {record.getMessage()}" + (" [traceback]" if record.exc_info else ""))


@dataclass
class Fuzz:
    """Both servers, started by `start()`; `ports` maps "serve"/"gate" to a loopback port."""

    ports: dict[str, int] = field(default_factory=dict)
    statuses: Counter = field(default_factory=Counter)
    cases: int = 0
    bad_logs: _BadLogs = field(default_factory=_BadLogs)
    plain_checks: int = 0  # plain requests sent to serve after a case
    killer: bytes | None = None  # the first case after which the engine served no plain request
    bad_input_5xx: int = 0  # 5xx answers to cases other than "valid" ones

    def start(self) -> Fuzz:
        from tierguard.engine.async_engine import AsyncLLMEngine
        from tierguard.model.tiny import ensure_tiny_model

        self.model_dir = ensure_tiny_model()
        self.engine = AsyncLLMEngine.from_model_dir(self.model_dir, model_name="tiny", max_model_len=MAX_MODEL_LEN,
                                                    kv_cache_gib=0.01, dtype="float32", device="cpu")
        vocab = self.engine.engine.model_config.vocab_size
        if vocab != VOCAB:
            raise AssertionError(f"the tiny model's vocabulary is {vocab}, the cases assume {VOCAB}")
        self._tmp = tempfile.TemporaryDirectory(prefix="tierguard-fuzz-")
        logging.getLogger().addHandler(self.bad_logs)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-servers", daemon=True)
        self._thread.start()
        self._call(self._start_servers())
        return self

    def _call(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start_servers(self) -> None:
        from aiohttp import web

        from tierguard.common.peer_conn import guarded_runner
        from tierguard.common.peers import PeerLimits
        from tierguard.gate.app import GUARD, build_app
        from tierguard.gate.policy import AdmissionPolicy, GateSettings
        from tierguard.serve.app import STATE_KEY, create_app

        limits = PeerLimits(header_timeout_s=5, body_timeout_s=5, slow_reader_bytes=1 << 20)
        self.serve_app = create_app(self.engine, api_key=SERVE_KEY, limits=limits, tokenizer_workers=1)
        self.serve_state = self.serve_app[STATE_KEY]
        self._runners = [guarded_runner(self.serve_state.guard, self.serve_app, handler_cancellation=True, access_log=None)]
        settings = GateSettings(upstream="http://127.0.0.1:1", api_keys=[GATE_KEY], upstream_api_key=SERVE_KEY,
                                jobs_dir=self._tmp.name + "/jobs", tokenizer=str(self.model_dir), tokenizer_workers=1,
                                header_timeout_s=5, body_timeout_s=5, async_workers=2,
                                policy=AdmissionPolicy(max_concurrency=4, max_queue=8, max_queue_wait_ms=3000))
        for name, make in (("serve", lambda: self.serve_app), ("gate", lambda: build_app(settings.validate()))):
            if name == "gate":
                settings.upstream = f"http://127.0.0.1:{self.ports['serve']}"
            app = make()
            runner = self._runners[0] if name == "serve" else guarded_runner(
                app[GUARD],
                app, handler_cancellation=True, access_log=None)
            if name == "gate":
                self._runners.append(runner)
                self.gate_app = app
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.ports[name] = runner.addresses[0][1]

    def stop(self) -> None:
        async def down() -> None:
            for r in reversed(self._runners):
                await r.cleanup()

        try:
            self._call(down())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            logging.getLogger().removeHandler(self.bad_logs)
            self._tmp.cleanup()

    # -- one case ---------------------------------------------------------------------------
    def send(self, target: str, raw: bytes, half_close: bool = False, timeout: float = 30.0) -> Answer:
        """`half_close`: end our side after the bytes (for noise that may not form a whole
        request: the server sees EOF instead of waiting for its header deadline)."""
        self.cases += 1
        with socket.create_connection(("127.0.0.1", self.ports[target]), timeout=timeout) as sock:
            try:
                sock.sendall(raw)
                if half_close:
                    sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server may answer and close before reading everything we send
            resp = http.client.HTTPResponse(sock)
            try:
                resp.begin()
                body = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, http.client.IncompleteRead) as exc:
                if isinstance(exc, http.client.IncompleteRead):
                    return Answer(resp.status, resp.getheader("Content-Type", ""), exc.partial, "incomplete")
                self.statuses["closed"] += 1
                return Answer(None, error=type(exc).__name__)
            except http.client.BadStatusLine as exc:
                return Answer(None, error=f"bad status line {exc!r}")
            except TimeoutError:  # a request left hanging: always a finding
                self.statuses["no answer"] += 1
                return Answer(None, error=f"{NO_ANSWER} {timeout:g} s")
        self.statuses[resp.status] += 1
        return Answer(resp.status, resp.getheader("Content-Type", ""), body)

    def engine_serves(self) -> bool:
        """A plain completion, straight to serve: does the engine still generate?"""
        self.plain_checks += 1
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 1}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.ports["serve"], timeout=60)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                           "Authorization": f"Bearer {SERVE_KEY}"})
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()
        return resp.status == 200 and b'"choices"' in data

    # -- after the cases ----------------------------------------------------------------------
    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Until the engine runs nothing and the gate holds no slot and no queued job."""
        from tierguard.gate.state import GATE

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            gate = self.gate_app[GATE]
            g = gate.controller.stats()
            if (s.num_running == 0 and s.num_waiting == 0 and not sum(g.in_flight.values())
                    and gate.runner.queue.empty()):
                return True
            time.sleep(0.05)
        return False

    def check_integrity(self) -> None:
        """The block pool's invariants (free + cached + used == total, ref counts = owners)."""
        self.engine.engine.check_integrity()
        if self.engine.stats().kv_blocks_used:
            raise AssertionError(f"{self.engine.stats().kv_blocks_used} KV blocks still held while idle")

    def alive(self) -> bool:
        for target in ("serve", "gate"):
            ans = self.send(target, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            if ans.status != 200:
                return False
        return True


def run_case(fuzz: Fuzz, case: tuple[str, bytes, bool, bool, str]) -> str | None:
    """Send one case, check its answer, then check that the engine still serves a plain
    request; None when all is well, else what went wrong."""
    target, raw, framing_ok, half_close, kind = case
    ans = fuzz.send(target, raw, half_close=half_close)
    problem = check(ans, framing_ok)
    if ans.status is not None and ans.status >= 500 and kind != "valid":
        fuzz.bad_input_5xx += 1
    if not fuzz.engine_serves() and fuzz.killer is None:  # checked after every case, dead or not
        fuzz.killer = raw
        problem = f"{problem + '; ' if problem else ''}the engine served no plain request after this case"
    return problem


def check(ans: Answer, framing_ok: bool) -> str | None:
    """None when `ans` is a well-formed answer; else what is wrong with it.

    `framing_ok`: the request was not valid HTTP (byte noise), so aiohttp's own plain-text
    400 or a closed connection are acceptable answers too."""
    if ans.status is None:
        return None if framing_ok and not ans.error.startswith(NO_ANSWER) else f"no response ({ans.error})"
    if ans.status >= 500:
        return f"{ans.status}: {ans.body[:300]!r}"
    if ans.error:
        return f"{ans.status} cut off: {ans.error}"
    if "text/event-stream" in ans.content_type:
        return _check_sse(ans.body)
    if "application/json" in ans.content_type:
        try:
            data = json.loads(ans.body)
        except ValueError:
            return f"{ans.status} with a body that is not JSON: {ans.body[:200]!r}"
        if ans.status >= 400 and not (isinstance(data, dict) and isinstance(data.get("error"), dict)
                                      and data["error"].get("message")):
            return f"{ans.status} without an error message: {data!r:.200}"
        return None
    if framing_ok and 400 <= ans.status < 500:
        return None  # not HTTP, or not our route: aiohttp's own plain-text refusal
    return f"{ans.status} with content type {ans.content_type!r}: {ans.body[:200]!r}"


def _check_sse(raw: bytes) -> str | None:
    blocks = [b for b in raw.split(b"\n\n") if b.strip()]
    if not blocks or blocks[-1].strip() != b"data: [DONE]":
        return f"SSE stream does not end with [DONE]: {raw[-200:]!r}"
    for b in blocks[:-1]:
        if not b.startswith(b"data: "):
            return f"SSE block without data: {b[:100]!r}"
        event = json.loads(b[6:])
        if "error" in event:
            return f"SSE error event: {event!r:.300}"
    return None


# -- what the fuzz sends --------------------------------------------------------------------------
_text = st.text(max_size=40) | st.sampled_from(["", "hello", "x" * 2000, "\u65e5\u672c" * 300, "\x00\ud800"])
_json_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | _text)
_json = st.recursive(_json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(_text, c, max_size=4),
                     max_leaves=12)


def _maybe(value_strategy):
    return st.one_of(st.just(None), value_strategy, _json_leaf)


_message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot", ""]) | _json_leaf,
    "content": _text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])},
                                                       optional={"text": _text}), max_size=3) | _json_leaf,
    "name": _text,
})
_near_valid = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "other"]) | _json_leaf,
    "prompt": _text | st.lists(st.integers(-5, 5000), max_size=30) | st.lists(_text, max_size=3) | _json,
    "messages": st.lists(_message, max_size=4) | _json_leaf,
    "max_tokens": st.integers(-3, 12) | _json_leaf,
    "max_completion_tokens": st.integers(-3, 12),
    "temperature": _maybe(st.floats(-1, 3)),
    "top_p": _maybe(st.floats(-0.5, 1.5)),
    "top_k": _maybe(st.integers(-3, 50)),
    "seed": _maybe(st.integers(-(2**70), 2**70)),
    "stream": st.booleans() | _json_leaf,
    "stream_options": _json | st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": _text | st.lists(_text, max_size=3) | _json_leaf,
    "stop_token_ids": st.lists(st.integers(-5, 5000), max_size=3) | _json_leaf,
    "n": st.integers(-1, 3), "ignore_eos": st.booleans(), "logprobs": _json_leaf, "echo": st.booleans(),
    "request_class": _text, "priority": _json_leaf, "service_tier": _json_leaf,
    "tierguard_async": st.booleans(), "tokens": st.lists(st.integers(-5, 5000), max_size=10) | _json_leaf,
    "add_generation_prompt": _json_leaf,
})
_words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
_valid_options = st.fixed_dictionaries({
    "max_tokens": st.integers(1, 8), "stream": st.booleans(), "temperature": st.floats(0, 2),
}, optional={
    "model": st.just("tiny"), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 50), "seed": st.integers(0, 2**32),
    "stop": st.lists(_words, max_size=2), "ignore_eos": st.booleans(), "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "request_class": st.sampled_from(["interactive", "batch"]), "tierguard_async": st.booleans(),
})
_valid_prompt = st.fixed_dictionaries({"prompt": _words | st.lists(st.integers(5, 4000), min_size=1, max_size=20)})
_valid_chat = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]), "content": _words}), min_size=1, max_size=3)})


def _valid(chat: bool):
    """A request the server should accept (the context may still be too short for it)."""
    return st.tuples(_valid_options, _valid_chat if chat else _valid_prompt).map(
        lambda t: {**t[0], **t[1], **({} if t[0].get("stream") else {"stream_options": None})})


_header_value = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
_ID_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789-._~%"
_headers = st.lists(st.tuples(st.sampled_from([
    "Content-Type", "Accept", "X-Tierguard-Priority", "X-Tierguard-Async", "x-tierguard-class",
    "Content-Encoding", "Expect", "X-Anything", "Cookie", "Range"]), _header_value), max_size=4,
    unique_by=lambda kv: kv[0].lower())  # a repeated singleton header is refused by aiohttp's parser itself


# -- engine cases: requests that parse, with sampling fields at and far beyond their edges ------
_INT64 = 2**63
_edge_ints = st.sampled_from([
    -(2**70), -_INT64 - 1, -_INT64, -2, -1, 0, 1, 2, 3, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 2**32, _INT64 - 1,
    _INT64, 2**64, 2**64 + 1, 10**30]) | st.integers(-(2**80), 2**80)
# NaN and Infinity: json.dumps writes them, and Python's and pydantic's JSON readers take them
_edge_floats = st.sampled_from([
    0.0, -0.0, 5e-324, 1e-300, 1e-8, 0.01, 0.5, 0.9, 1.0, 1.0000001, 2.0, 1e300, float("inf"), float("-inf"),
    float("nan")]) | st.floats()
_edge_stops = (st.lists(_words, max_size=20) | _words | st.sampled_from(
    [["x"] * 16, ["x"] * 17, ["y" * 256], "y" * 257, ["a"] * 5000, [""] * 30, ["\ufffd", "\n"]]))
_edge_stop_ids = st.lists(_edge_ints, max_size=5) | st.sampled_from([[1] * 64, [1] * 65, list(range(2000)), [VOCAB]])
_edges = st.fixed_dictionaries({}, optional={
    "seed": _edge_ints, "top_k": _edge_ints, "max_tokens": _edge_ints, "max_completion_tokens": _edge_ints,
    "temperature": _edge_floats, "top_p": _edge_floats, "presence_penalty": _edge_floats,
    "frequency_penalty": _edge_floats, "stop": _edge_stops, "stop_token_ids": _edge_stop_ids, "n": _edge_ints,
    "best_of": _edge_ints, "priority": _edge_ints, "ignore_eos": st.booleans(),
})
# What the edges are laid over: a request that samples (temperature > 0, top_p < 1 filters).
_sampling_base = st.fixed_dictionaries({
    "model": st.just("tiny"), "max_tokens": st.integers(1, 4), "temperature": st.floats(0.1, 2),
    "top_p": st.floats(0.05, 0.99), "stream": st.booleans()})


def _engine_body(chat: bool):
    return st.tuples(_sampling_base, _edges, _valid_chat if chat else _valid_prompt).map(
        lambda t: {**t[0], **t[1], **t[2]})


def request_case(target: str, path: str, body: dict, kind: str = "engine") -> tuple[str, bytes, bool, bool, str]:
    """One well-framed, authorized POST of `body` (a case in `http_case`'s shape)."""
    payload = json.dumps(body).encode()
    key = SERVE_KEY if target == "serve" else GATE_KEY
    head = (f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    return target, head.encode() + payload, False, False, kind


_KILL = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
# Requests that stop an engine without range checks and failure isolation: the run must be
# able to catch them, so every run sends them first.
KILLERS = [request_case(t, "/v1/completions", {**_KILL, **extra}) for t in ("serve", "gate") for extra in (
    {"top_k": 10**30, "top_p": 0.9},  # OverflowError in the batched sampler
    {"seed": 2**64},  # 65 bits: make_generator raised while the request was added
    {"stop": ["a"] * 5000, "stream": True},  # work on the engine thread for every token
)]


@st.composite
def http_case(draw) -> tuple[str, bytes, bool, bool, str]:
    """(target, raw request bytes, whether the bytes may be invalid HTTP, whether to end our
    side after them: noise may never form a whole request, and the server would otherwise
    wait for its header deadline; the kind of case)."""
    target = draw(st.sampled_from(["serve", "gate"]))
    kind = draw(st.sampled_from(["valid", "valid", "valid", "near_valid", "near_valid", "json", "noise_body",
                                 "job_get", "byte_noise", "engine", "engine", "engine"]))
    if kind == "byte_noise":
        prefix = draw(st.sampled_from([b"", b"POST /v1/completions HTTP/1.1\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n"]))
        return target, prefix + draw(st.binary(max_size=600)), True, True, kind
    if kind == "engine":
        return engine_case(draw, target)
    routes = SERVE_ROUTES if target == "serve" else GATE_ROUTES
    path, method = draw(st.sampled_from(routes)), "POST"
    if kind == "job_get" and target == "gate":  # serve has no job routes
        method, path = "GET", "/v1/async/" + draw(st.sampled_from(["job-" + "0" * 32, "job-..%2F..%2Fetc"])
                                                  | st.text(_ID_CHARS, min_size=1, max_size=40))
    if kind == "valid":
        body = json.dumps(draw(_valid("chat" in path or (path == "/tokenize" and draw(st.booleans()))))).encode()
    elif kind == "near_valid":
        body = json.dumps(draw(_near_valid)).encode()
    elif kind == "json":
        body = json.dumps(draw(_json)).encode()
    else:
        body = draw(st.binary(max_size=400))
    key = SERVE_KEY if target == "serve" else GATE_KEY
    auth = draw(st.sampled_from([f"Bearer {key}"] * 4 + ["", "Bearer wrong", "Basic abc"]))
    lines = [f"{method} {path} HTTP/1.1", "Host: fuzz", "Connection: close"]
    if auth:
        lines.append(f"Authorization: {auth}")
    extra = draw(_headers)
    lines += [f"{k}: {v}" for k, v in extra]
    if "Content-Type" not in {k for k, _ in extra}:
        lines.append("Content-Type: application/json")
    declared = max(0, len(body) - draw(st.sampled_from([0, 0, 0, 1, 5])))  # sometimes shorter than sent
    lines.append(f"Content-Length: {declared}")
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    return target, raw, declared != len(body), False, kind


def engine_case(draw, target: str | None = None) -> tuple[str, bytes, bool, bool, str]:
    """A request that reaches the engine's parameters (see `_edges`)."""
    target = target or draw(st.sampled_from(["serve", "gate"]))
    path = draw(st.sampled_from(GATE_ROUTES[:2] if target == "serve" else GATE_ROUTES))
    return request_case(target, path, draw(_engine_body("chat" in path)))


engine_cases = st.composite(engine_case)
