"""One place that turns a Redis URL into a client: a single node or a Redis Cluster.

    redis://HOST:PORT[/DB]                    one node (rediss:// with TLS, unix://PATH a socket)
    redis+cluster://H1:P1[,H2:P2,...]         a Redis Cluster, seeded by one or more of its nodes
                                              (a node without :PORT is on 6379, as redis-py reads it)
    rediss+cluster://H1:P1[,...]              the same over TLS
    redis://H1:P1,H2:P2[,...]                 several seeds name a cluster too

Credentials ride in the URL as usual (`redis+cluster://user:password@H1:P1,H2:P2`) and
apply to every node. A cluster has one database: `/0` or none.

What a caller may assume:
- `parse_redis_url` raises `ValueError` with a one-line reason for anything else, before
  any connection is tried.
- `sync_client` / `async_client` build a `redis.Redis` or a `redis.cluster.RedisCluster`
  (the asyncio ones for `async_client`) with the given timeouts on every connection, no
  retries of their own (the caller's breaker or fallback decides), and, for a cluster,
  `require_full_coverage=False`: a shard whose master is down costs only its own slots.
  Redirections (`MOVED`, `ASK`), topology refreshes and failovers are redis-py's: nothing
  here, nor in its callers, interprets them.
- `sync_client` for a cluster contacts a seed at once (redis-py reads the slot map in the
  constructor) and raises `redis.RedisError` or `RedisClusterException` when none
  answers; `async_client` connects on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
URL_FORMS = "redis://HOST:PORT[/DB] or redis+cluster://HOST:PORT[,HOST:PORT...]"


@dataclass(frozen=True)
class RedisTarget:
    """What a URL names: one node (`url` as given) or a cluster's seeds."""

    url: str = field(repr=False)  # may hold credentials
    cluster: bool
    seeds: tuple[tuple[str, int], ...] = ()
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)


def _shown(url: str) -> str:
    """`url` for an error message: credentials replaced by ***."""
    scheme, sep, rest = url.partition("://")
    _, at, hosts = rest.rpartition("@")
    return f"{scheme}{sep}***@{hosts}" if at else url


def _host_port(part: str, shown: str) -> tuple[str, int]:
    """HOST[:PORT] or [V6][:PORT]; no port is 6379 (redis-py's default)."""
    if part.startswith("["):
        host, _, rest = part[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{shown!r}: bad node {part!r}")
        port = rest[1:]
    else:
        host, _, port = part.partition(":") if part.count(":") == 1 else (part, "", "")
    if not host:
        raise ValueError(f"{shown!r} names no host in {part!r}")
    port = port or "6379"
    if not port.isdigit():
        raise ValueError(f"{shown!r}: the port must be a number, got {port!r}")
    if not 0 < int(port) < 65536:
        raise ValueError(f"{shown!r}: port {port} out of range 1..65535")
    return host, int(port)


def parse_redis_url(url: str) -> RedisTarget:
    if not isinstance(url, str) or not url:
        raise ValueError(f"expected {URL_FORMS}, got {url!r}")
    scheme, sep, rest = url.partition("://")
    shown = _shown(url)
    if not sep:
        raise ValueError(f"expected {URL_FORMS}, got {shown!r}")
    if scheme == "unix":
        if not rest:
            raise ValueError(f"{shown!r}: unix:// needs a socket path")
        return RedisTarget(url, cluster=False)
    if scheme not in ("redis", "rediss", *CLUSTER_SCHEMES):
        raise ValueError(f"expected {URL_FORMS}, got {shown!r}")
    auth, at, hosts = rest.rpartition("@")
    if not at:
        auth, hosts = "", rest
    hosts, _, query = hosts.partition("?")
    url_shown, url = url, shown  # below, messages name the URL without its credentials
    hosts, _, db = hosts.partition("/")
    seeds = []
    for part in hosts.split(","):
        seeds.append(_host_port(part.strip(), url))
    cluster = scheme in CLUSTER_SCHEMES or len(seeds) > 1
    if db and not db.isdigit():
        raise ValueError(f"{url!r}: the database must be a number, got {db!r}")
    if cluster and db not in ("", "0"):
        raise ValueError(f"{url!r}: a Redis Cluster has only database 0")
    if cluster and query:
        raise ValueError(f"{url!r}: a cluster URL takes no ?options")
    url = url_shown
    if not cluster:
        return RedisTarget(url, cluster=False)
    user, colon, password = auth.partition(":")  # as redis-py reads a URL: user[:password]@
    return RedisTarget(url, cluster=True, seeds=tuple(seeds), tls=CLUSTER_SCHEMES.get(scheme, scheme) == "rediss",
                       username=unquote(user) or None, password=unquote(password) or None if colon else None)


def _cluster_kwargs(t: RedisTarget, options: dict[str, Any]) -> dict[str, Any]:
    kw = dict(options)
    if t.username:
        kw.setdefault("username", t.username)
    if t.password:
        kw.setdefault("password", t.password)
    if t.tls:
        kw.setdefault("ssl", True)
    return kw


def sync_client(url: str, *, timeout_s: float, **options: Any) -> redis.Redis | RedisCluster:
    """A blocking client for `url`; `options` go to every connection (TLS files, a password...)."""
    t = parse_redis_url(url)
    common = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **options)
    if not t.cluster:
        return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **common)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in t.seeds], require_full_coverage=False,
                        retry=Retry(NoBackoff(), 0), **_cluster_kwargs(t, common))


def async_client(url: str, *, timeout_s: float | None, connect_timeout_s: float, max_connections: int,
                 **options: Any) -> aioredis.Redis | AsyncRedisCluster:
    """An asyncio client for `url`. One node: a blocking pool of `max_connections` (a caller
    waits up to `connect_timeout_s` for a free one); a cluster: up to `max_connections` per
    node (the caller bounds its own concurrency below that)."""
    t = parse_redis_url(url)
    common = dict(socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s, **options)
    if not t.cluster:
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                        timeout=connect_timeout_s, retry=AsyncRetry(NoBackoff(), 0),
                                                        health_check_interval=0, **common)
        return aioredis.Redis(connection_pool=pool)
    return AsyncRedisCluster(startup_nodes=[AsyncClusterNode(h, p) for h, p in t.seeds], require_full_coverage=False,
                             retry=AsyncRetry(NoBackoff(), 0), max_connections=max_connections,
                             **_cluster_kwargs(t, common))


def is_cluster(client: Any) -> bool:
    return isinstance(client, (RedisCluster, AsyncRedisCluster))
