"""Slots as leases in Redis, shared by every gate that names the same Redis (--shared-state).

Why leases: a gate killed with SIGKILL never says goodbye. Every slot it holds is a
member of a sorted set scored by its expiry time; the holder renews its leases every
lease/3, everyone else reaps expired ones inside each script. So a dead gate's slots
come back within one lease time, and a live gate never loses one it renews.

Keys (prefix P, default `tierguard:gate`; one prefix per fleet). Every key carries the
hash tag `{P}`, so on a Redis Cluster (`--shared-state redis+cluster://...`) all of a
fleet's keys live in one slot, on one shard, and each script below stays one atomic step
there (a script's keys must share a slot; redis-py refuses one that spreads them):

    {P}:slots          ZSET lease -> expiry ms      every running request of every gate
    {P}:long           ZSET lease -> expiry ms      the long ones among them
    {P}:q:{0,1,2,3}    ZSET waiter -> arrival seq   interactive, long, batch, async-job queues (FIFO)
    {P}:wexp           ZSET waiter -> expiry ms     waiters are leased too, shorter: a dead gate's go fast
    {P}:seq            counter                      arrival order across gates
    {P}:gates          ZSET gate id -> expiry ms    live gates (the fallback share, see below)
    channel {P}:freed                               published when a slot or a queue place frees

The wake-up channel is classic pub/sub: a PUBLISH reaches subscribers on every node of a
cluster, so the subscriber (redis-py's cluster pub/sub) may sit on any of them; wake-ups
only shorten waits (waiters also poll), so one lost in a failover costs a poll period.

Waiters hold a shorter lease than slots (`waiter_ms`, a fifth of the slot lease, at least
200 ms), refreshed by their gate every third of it: a dead gate's queued requests are
ahead of everyone else's in the FIFO, so they must leave sooner than its slots free,
or the whole fleet would wait a lease time for requests nobody will run.

Time is Redis's own clock (`TIME` inside the scripts), so gates on different hosts
never compare their clocks. Every script is atomic: the check "is a slot free and am
I first in line" and the grant are one step, whoever calls.

Order across gates mirrors the local controller: interactive, long, batch, then async
jobs; FIFO within a queue. A waiter takes a slot when the free slots outnumber the
waiters ahead of it (earlier in its queue, plus those of earlier queues; long waiters
count only as far as long slots are free, as a long waiter cannot take more).

Every call is bounded by `timeout_s` (connect, command, and an asyncio deadline around
both) and raises `SharedDown` on any failure, never hangs: the caller decides what an
unreachable Redis means (`shared_admission.py`: the local share). On a cluster, the
node that answers for the fleet's slot is watched: `moves` counts each time it changed
(a failover, or the slot migrated), which the caller treats like an outage, because the
new master may lack the last writes of the old one (replication is asynchronous).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from tierguard.common.redact import redact_url
from tierguard.common.redis_client import async_client, is_cluster

QUEUES = ("interactive", "long", "batch", "async")  # queue order; index = position in the scripts

_REAP = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 500)
if #expired > 0 then
  redis.call('ZREM', KEYS[1], unpack(expired))
  redis.call('ZREM', KEYS[2], unpack(expired))
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now, 'LIMIT', 0, 500)
if #gone > 0 then
  redis.call('ZREM', KEYS[7], unpack(gone))
  for i = 3, 6 do redis.call('ZREM', KEYS[i], unpack(gone)) end
end
"""

# KEYS: slots long q0 q1 q2 q3 wexp seq
# ARGV: queue(0..3) is_long lease mode(new|queued) lease_ms max_concurrency max_long max_queue(0: unbounded)
#       waiter_ms
# returns {status, reaped leases, reaped waiters, place, next}: status 1 granted, 0 waiting, 2 queue full,
# -1 lost its place; place = the waiter's arrival number when it joins (local queues keep that order);
# next = ms until the earliest slot lease expires (when waiting: the waiter asks again then)
_ACQUIRE = _REAP + """
local q = tonumber(ARGV[1])
local is_long = ARGV[2] == '1'
local id = ARGV[3]
local mode = ARGV[4]
local lease_ms = tonumber(ARGV[5])
local myq = KEYS[3 + q]
local free = tonumber(ARGV[6]) - redis.call('ZCARD', KEYS[1])
local long_free = math.max(0, tonumber(ARGV[7]) - redis.call('ZCARD', KEYS[2]))
local rank
if mode == 'queued' then
  rank = redis.call('ZRANK', myq, id)
  if not rank then return {-1, #expired, #gone} end
else
  rank = redis.call('ZCARD', myq)
end
local ahead = rank
local long_ahead = 0
for i = 0, q - 1 do
  local n = redis.call('ZCARD', KEYS[3 + i])
  if i == 1 then
    n = math.min(n, long_free)
    long_ahead = n
  end
  ahead = ahead + n
end
if q == 1 then long_ahead = rank end
if free > ahead and (not is_long or long_free > long_ahead) then
  redis.call('ZADD', KEYS[1], now + lease_ms, id)
  if is_long then redis.call('ZADD', KEYS[2], now + lease_ms, id) end
  if mode == 'queued' then
    redis.call('ZREM', myq, id)
    redis.call('ZREM', KEYS[7], id)
  end
  return {1, #expired, #gone}
end
local waiter_ms = tonumber(ARGV[9])
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local next = -1
if #first == 2 then next = math.max(0, tonumber(first[2]) - now) end
if mode == 'queued' then
  redis.call('ZADD', KEYS[7], now + waiter_ms, id)
  return {0, #expired, #gone, 0, next}
end
local max_queue = tonumber(ARGV[8])
if max_queue > 0 and redis.call('ZCARD', myq) >= max_queue then return {2, #expired, #gone} end
local place = redis.call('INCR', KEYS[8])
redis.call('ZADD', myq, place, id)
redis.call('ZADD', KEYS[7], now + waiter_ms, id)
return {0, #expired, #gone, place, next}
"""

# KEYS: slots long q0 q1 q2 q3 wexp ; ARGV: lease-or-waiter id ; channel name in ARGV[2]
_RELEASE = """
local n = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
for i = 3, 7 do redis.call('ZREM', KEYS[i], ARGV[1]) end
redis.call('PUBLISH', ARGV[2], ARGV[1])
return n
"""

# KEYS: slots long q0 q1 q2 q3 wexp seq gates
# ARGV: gate lease_ms n_leases lease_1 long_1 ...
# returns {reaped leases, reaped waiters, leases re-added, live gates}
_RENEW = _REAP + """
local lease_ms = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local readded = 0
for i = 0, n - 1 do
  local id = ARGV[4 + 2 * i]
  readded = readded + redis.call('ZADD', KEYS[1], now + lease_ms, id)
  if ARGV[5 + 2 * i] == '1' then redis.call('ZADD', KEYS[2], now + lease_ms, id) end
end
redis.call('ZADD', KEYS[9], now + lease_ms, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[9], '-inf', now)
return {#expired, #gone, readded, redis.call('ZCARD', KEYS[9])}
"""

# KEYS: wexp ; ARGV: waiter_ms waiter_1 ... ; returns the waiters that had lost their place
_TOUCH = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local lost = {}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""


class SharedDown(Exception):
    """Redis did not answer in time, refused, or failed. `refused`: nothing listens or the
    connection broke (Redis is gone for sure), as opposed to a slow answer."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass
class Acquired:
    status: int  # 1 granted, 0 waiting, 2 queue full, -1 lost its place in the queue
    reaped: int  # expired leases this call removed (another gate stopped renewing them)
    place: int = 0  # arrival number in the fleet-wide queue, when it just joined one
    next_expiry_ms: int = -1  # when waiting: ms until the earliest slot lease expires (-1: none held)

    @property
    def granted(self) -> bool:
        return self.status == 1


@dataclass
class Renewed:
    reaped: int
    readded: int  # held leases that had expired (or were never written, e.g. admitted while Redis was down)
    live_gates: int


class LeaseStore:
    """The Redis side of shared slots. One per gate process; `gate_id` names its leases."""

    def __init__(self, url: str, *, prefix: str = "tierguard:gate", lease_ms: int = 5000,
                 timeout_s: float = 0.1, max_connections: int = 32) -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"the shared key prefix must be non-empty, without braces (it becomes the "
                             f"keys' hash tag), got {prefix!r}")
        self.url = redact_url(url)  # for logs and messages: never the password
        self.prefix = prefix
        self.lease_ms = int(lease_ms)
        self.waiter_ms = max(200, self.lease_ms // 5)
        self.timeout_s = timeout_s
        self.gate_id = os.urandom(6).hex()
        self._n = 0
        self.client: Any = async_client(url, timeout_s=timeout_s, connect_timeout_s=timeout_s,
                                        max_connections=max_connections + 4)  # + the pub/sub connection
        self.cluster = is_cluster(self.client)
        # Pub/sub holds one connection open and reads with its own timeout (get_message); on a
        # cluster it is a connection of the cluster client's own (redis-py's cluster pub/sub).
        self.sub_client: Any = self.client if self.cluster else async_client(
            url, timeout_s=None, connect_timeout_s=timeout_s, max_connections=2)
        self._slots = asyncio.Semaphore(max_connections)  # calls in flight (a cluster node does not queue them)
        self.master: str | None = None  # the cluster node that answered for the fleet's slot last
        self.moves = 0  # times that node changed (failover or migration)
        tag = "{" + prefix + "}"
        self.channel = f"{tag}:freed"
        k = [f"{tag}:{x}" for x in ("slots", "long", "q:0", "q:1", "q:2", "q:3", "wexp", "seq", "gates")]
        self._keys = k
        self._acquire = self.client.register_script(_ACQUIRE)
        self._release = self.client.register_script(_RELEASE)
        self._renew = self.client.register_script(_RENEW)
        self._touch = self.client.register_script(_TOUCH)

    def new_id(self) -> str:
        self._n += 1
        return f"{self.gate_id}:{self._n}"

    async def _call(self, script, keys: list[str], args: list):
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                async with self._slots:
                    out = await script(keys=keys, args=args)
        except (RedisConnectionError, OSError) as exc:
            # the pool's own wait for a free connection is slowness, not a dead Redis
            busy = isinstance(exc.__cause__, asyncio.TimeoutError)
            raise SharedDown(f"{type(exc).__name__}: {exc}"[:200], refused=not busy) from None
        except (RedisError, RedisClusterException, TimeoutError) as exc:
            raise SharedDown(f"{type(exc).__name__}: {exc}"[:200]) from None
        if self.cluster:
            try:
                self._saw(self.client.get_node_from_key(self._keys[0]).name)
            except (RedisClusterException, KeyError, AttributeError):
                pass  # the slot map is being read again: the next call tells
        return out

    def _saw(self, master: str) -> None:
        if self.master is not None and master != self.master:
            self.moves += 1
        self.master = master

    async def subscriber(self) -> Any:
        """A pub/sub object to subscribe to `channel` with (on a cluster, once the slot map is read)."""
        if self.cluster:
            await self.client.initialize()
        return self.sub_client.pubsub()

    async def acquire(self, queue: int, is_long: bool, lease: str, *, queued: bool, max_concurrency: int,
                      max_long: int, max_queue: int) -> Acquired:
        """Take a slot for `lease`, or join queue `queue` (queued=False: a new arrival; max_queue 0:
        no bound), or, when already queued, learn whether it is its turn now."""
        r = await self._call(self._acquire, self._keys[:8],
                             [queue, int(is_long), lease, "queued" if queued else "new", self.lease_ms,
                              max_concurrency, max_long, max_queue, self.waiter_ms])
        return Acquired(int(r[0]), int(r[1]), int(r[3]) if len(r) > 3 else 0, int(r[4]) if len(r) > 4 else -1)

    async def release(self, lease: str) -> bool:
        """Free a slot or leave a queue (publishes a wake-up); False when it had already expired."""
        return bool(await self._call(self._release, self._keys[:7], [lease, self.channel]))

    async def renew(self, leases: list[tuple[str, bool]]) -> Renewed:
        """Extend every held lease by one lease time (writing back any that expired); heartbeat this gate."""
        args: list = [self.gate_id, self.lease_ms, len(leases)]
        for lease, is_long in leases:
            args += [lease, int(is_long)]
        r = await self._call(self._renew, self._keys, args)
        return Renewed(int(r[0]), int(r[2]), int(r[3]))

    async def touch(self, waiters: list[str]) -> list[str]:
        """Keep these queue places for one more waiter lease; returns those already lost."""
        r = await self._call(self._touch, [self._keys[6]], [self.waiter_ms, *waiters])
        return [x.decode() if isinstance(x, bytes) else str(x) for x in r]

    async def counts(self) -> dict[str, int]:
        """Slots held and waiters per queue, fleet-wide (for /health and tests)."""
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                async with self.client.pipeline(transaction=False) as p:
                    for key in (self._keys[0], self._keys[1], *self._keys[2:6]):
                        p.zcard(key)
                    r = await p.execute()
        except (RedisError, RedisClusterException, TimeoutError, OSError) as exc:
            raise SharedDown(type(exc).__name__) from None
        return {"slots": r[0], "long": r[1], **{f"queued_{q}": n for q, n in zip(QUEUES, r[2:], strict=True)}}

    async def reset(self) -> None:
        """Drop every pooled connection: after Redis died, each of them would fail once more
        (a restarted Redis closed them) and look like a new outage. A cluster client does
        that itself: a failed connection has it drop the node's idle connections and read
        the slot map again on its next call."""
        if self.cluster:
            return
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                await self.client.connection_pool.disconnect()
        except (RedisError, TimeoutError, OSError):
            pass

    async def close(self) -> None:
        for c in {id(c): c for c in (self.client, self.sub_client)}.values():
            try:
                async with asyncio.timeout(1.0):
                    await c.aclose()
            except (RedisError, RedisClusterException, TimeoutError, OSError):
                pass
