"""Variants that start real subprocess servers for sweep tests."""

from __future__ import annotations

import sys

PY = sys.executable


def schedule_variant(name: str, capacity: int, ttft_ms: float = 50, itl_ms: float = 20, **extra) -> dict:
    cmd = [
        PY,
        "-m",
        "tierguard.bench.schedule_server",
        "--port",
        "{port}",
        "--ttft-ms",
        str(ttft_ms),
        "--itl-ms",
        str(itl_ms),
        "--capacity",
        str(capacity),
    ]
    return {
        "name": name,
        "command": cmd,
        "start_timeout_s": 30,
        "stop_grace_s": 3,
        "warmup_requests": 1,
        **extra,
    }


def failing_variant(name: str = "broken") -> dict:
    return {
        "name": name,
        "command": [PY, "-c", "import sys; print('cannot allocate KV'); sys.exit(3)"],
        "start_timeout_s": 20,
    }


# A server that ignores SIGTERM: stop() must fall back to SIGKILL after the grace period.
STUBBORN = r"""
import signal, sys, json
from http.server import BaseHTTPRequestHandler, HTTPServer
signal.signal(signal.SIGTERM, signal.SIG_IGN)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header('Content-Type', 'application/json'); self.end_headers()
        self.wfile.write(json.dumps({'data': [{'id': 'stub'}]}).encode())
    def log_message(self, *a): pass
HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


def stubborn_variant(name: str = "stubborn") -> dict:
    return {
        "name": name,
        "command": [PY, "-c", STUBBORN, "{port}"],
        "start_timeout_s": 20,
        "stop_grace_s": 0.5,
        "warmup_requests": 0,
    }
