"""The lean HTTP client: response framing survives any split of the byte stream."""

from __future__ import annotations

import asyncio

import pytest

from tierguard.bench.rawhttp import _Response
from tierguard.bench.records import RequestRecord
from tierguard.bench.sse import SSEAccumulator


def _events(n: int) -> bytes:
    return b"".join(b'data: {"id": "r1", "choices": [{"text": " t"}], "usage": {"completion_tokens": %d}}\n\n' % (i + 1)
                    for i in range(n)) + b"data: [DONE]\n\n"


def _chunked(body: bytes, piece: int) -> bytes:
    out = b""
    for i in range(0, len(body), piece):
        part = body[i:i + piece]
        out += b"%x;ext=1\r\n%b\r\n" % (len(part), part)
    return out + b"0\r\n\r\n"


def _feed(raw: bytes, cut: int) -> tuple[RequestRecord, bool, _Response]:
    loop = asyncio.new_event_loop()
    try:
        fut = loop.create_future()
        rec = RequestRecord(index=0)
        resp = _Response(SSEAccumulator(rec), 0.0, fut)
        for i in range(0, len(raw), cut):
            resp.on_data(raw[i:i + cut])
        return rec, fut.done(), resp
    finally:
        loop.close()


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 64, 100000])
def test_chunked_body_split_anywhere(cut):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    rec, finished, resp = _feed(head + _chunked(_events(5), 37), cut)
    assert finished and resp.keep_alive
    assert rec.chunk_tokens == [1] * 5 and rec.response_id == "r1" and rec.http_status is None
    assert resp.status == 200 and rec.headers_s is not None


@pytest.mark.parametrize("cut", [1, 5, 1000])
def test_content_length_error_body(cut):
    body = b'{"error": {"message": "bad field ignore_eos"}}'
    head = b"HTTP/1.1 422 Unprocessable\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    rec, finished, resp = _feed(head + body, cut)
    assert finished and resp.status == 422 and resp.error_body == body and not resp.keep_alive
    assert rec.chunk_times_s == []


def test_connection_close_delimited_body_ends_on_close():
    loop = asyncio.new_event_loop()
    try:
        fut = loop.create_future()
        rec = RequestRecord(index=0)
        resp = _Response(SSEAccumulator(rec), 0.0, fut)
        resp.on_data(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + _events(3))
        assert not fut.done()
        resp.on_lost()
        assert fut.done() and fut.exception() is None and rec.chunk_tokens == [1, 1, 1]
    finally:
        loop.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nnot hex\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\nbody",
    ],
)
def test_malformed_framing_fails_the_request_instead_of_hanging(raw):
    from tierguard.bench.rawhttp import TransportFailed

    loop = asyncio.new_event_loop()
    try:
        fut = loop.create_future()
        resp = _Response(SSEAccumulator(RequestRecord(index=0)), 0.0, fut)
        resp.on_data(raw)  # must not raise into the transport callback
        assert fut.done() and isinstance(fut.exception(), TransportFailed)
        assert "malformed HTTP response" in str(fut.exception()) and not resp.keep_alive
    finally:
        loop.close()
