"""The work queued for each upstream, shared by the gates of one fleet through Redis.

Predicted admission prices a request by the prefill work ahead of it at its upstream:
with several gates in front of one fleet, the work the others sent or hold counts too.
Every `PERIOD_S` each gate writes its own figures per upstream URL (prefill tokens sent
and not yet done, their keys, tokens waiting in the gate, their keys, running decodes)
into one hash field under its id, and reads back everyone else's, in one script:

    P:{work}          HASH gate id -> JSON {upstream URL: [sent, keys, queued, keys, decodes]}
    P:{work}:gates    ZSET gate id -> expiry ms (Redis's clock), reaped by the script

A gate that stops writing (killed) leaves the sums within one lease time (`--lease-ms`).
The two keys share a hash tag, so the script runs on one node of a Redis Cluster too.
Gates must name each upstream by the same URL.

Redis unreachable: the other gates' last figures are kept for one lease time, then this
gate prices by its own work alone (as a lone gate would), counted in `errors` and `up`;
every call is bounded by the timeout and nothing waits on Redis but this loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from tierguard.gate.ttft_upstream import Others

log = logging.getLogger("tierguard.gate")
PERIOD_S = 0.1

_PUBLISH = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 100)
if #gone > 0 then
  redis.call('ZREM', KEYS[2], unpack(gone))
  redis.call('HDEL', KEYS[1], unpack(gone))
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
return redis.call('HGETALL', KEYS[1])
"""


class SharedWork:
    """Publishes `controller.local_work()` and sets each upstream's `others`."""

    def __init__(self, url: str, *, prefix: str = "tierguard:gate", lease_ms: int = 5000,
                 timeout_s: float = 0.1) -> None:
        self.url = url
        self.lease_ms = int(lease_ms)
        self.timeout_s = timeout_s
        self.gate_id = os.urandom(6).hex()
        self.keys = [f"{prefix}:{{work}}", f"{prefix}:{{work}}:gates"]
        self.client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                              retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._script = self.client.register_script(_PUBLISH)
        self.up = False
        self.errors = 0
        self.live_gates = 1
        self._last_ok = -1e18
        self._task: asyncio.Task | None = None
        self._closing = False

    async def start(self, controller) -> None:
        self._controller = controller
        await self.publish_once()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(1.0):
                await self.client.aclose()

    async def _loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(PERIOD_S)
            await self.publish_once()

    async def publish_once(self) -> None:
        mine = json.dumps(self._controller.local_work(), separators=(",", ":"))
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                flat = await self._script(keys=self.keys, args=[self.gate_id, self.lease_ms, mine])
        except (RedisError, OSError, TimeoutError) as exc:
            self.errors += 1
            if self.up:
                log.warning("shared work state %s unreachable (%s): pricing by this gate's own work "
                            "after one lease", self.url, type(exc).__name__)
            self.up = False
            if time.monotonic() - self._last_ok > self.lease_ms / 1000:
                self._apply({})
            return
        if not self.up:
            log.info("shared work state %s answers", self.url)
        self.up, self._last_ok = True, time.monotonic()
        others: dict[str, list[float]] = {}
        pairs = [(flat[i], flat[i + 1]) for i in range(0, len(flat) - 1, 2)]
        self.live_gates = len(pairs)
        for gate, value in pairs:
            if (gate.decode() if isinstance(gate, bytes) else str(gate)) == self.gate_id:
                continue
            try:
                table = json.loads(value)
            except (ValueError, TypeError):
                continue  # another version's value: not ours to read
            for url, row in table.items() if isinstance(table, dict) else ():
                if isinstance(row, list) and len(row) == 5 and all(isinstance(v, (int, float)) for v in row):
                    acc = others.setdefault(url, [0.0] * 5)
                    for i, v in enumerate(row):
                        acc[i] += max(0.0, float(v))
        self._apply(others)

    def _apply(self, others: dict[str, list[float]]) -> None:
        for u in self._controller.upstreams:
            row = others.get(u.url)
            u.others = Others() if row is None else Others(tokens=row[0] + row[2], keys=row[1] + row[3],
                                                          decodes=row[4], sent_tokens=row[0])
