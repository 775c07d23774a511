"""One URL, one client (tierguard/common/redis_client.py): which URLs name one node, which a
Redis Cluster, and the one-line errors for the rest; then the clients against a real cluster."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from tierguard.common.redis_client import async_client, is_cluster, parse_redis_url, sync_client


@pytest.mark.parametrize("url, cluster, seeds", [
    ("redis://10.0.0.1:6379/2", False, ()),
    ("rediss://user:pw@10.0.0.1:6380/0", False, ()),
    ("unix:///run/redis.sock", False, ()),
    ("redis://[::1]:6379", False, ()),
    ("redis+cluster://10.0.0.1:7000", True, (("10.0.0.1", 7000),)),
    ("redis+cluster://a:7000,b:7001,c", True, (("a", 7000), ("b", 7001), ("c", 6379))),
    ("redis://a:7000,b:7001/0", True, (("a", 7000), ("b", 7001))),  # several seeds: a cluster
    ("rediss+cluster://[::1]:7000", True, (("::1", 7000),)),
])
def test_a_url_names_one_node_or_a_cluster(url, cluster, seeds):
    t = parse_redis_url(url)
    assert (t.cluster, t.seeds) == (cluster, seeds)
    assert t.tls == url.startswith("rediss") or not cluster


def test_cluster_credentials_and_tls_come_from_the_url():
    t = parse_redis_url("rediss+cluster://app:s%40cret@a:7000,b:7000")
    assert (t.username, t.password, t.tls) == ("app", "s@cret", True)
    assert "s@cret" not in repr(t) and "s%40cret" not in repr(t)
    assert parse_redis_url("redis+cluster://:pw@a:7000").password == "pw"


@pytest.mark.parametrize("url, words", [
    ("http://a:1", "expected redis://"),
    ("127.0.0.1:6379", "expected redis://"),
    ("redis+cluster://a:7000/1", "only database 0"),
    ("redis+cluster://a:7000?ssl_cert_reqs=none", "takes no"),
    ("redis://a:99999", "out of range"),
    ("redis://a:x1", "must be a number"),
    ("redis+cluster://a:1,:2", "names no host"),
    ("redis://a:1/x", "database must be a number"),
    ("unix://", "socket path"),
])
def test_a_bad_url_is_one_clear_error(url, words):
    with pytest.raises(ValueError, match=words):
        parse_redis_url(url)


def test_an_error_never_shows_the_password():
    with pytest.raises(ValueError) as e:
        parse_redis_url("redis+cluster://app:hunter2@a:7000/5")
    assert "hunter2" not in str(e.value) and "***@" in str(e.value)


def test_the_clients_built_for_each_kind(redis_cluster, redis_server):
    one = sync_client(redis_server.url, timeout_s=0.5)
    assert isinstance(one, redis.Redis) and not is_cluster(one) and one.ping()
    many = sync_client(redis_cluster.url, timeout_s=0.5)
    assert isinstance(many, RedisCluster) and is_cluster(many)
    assert {n.port for n in many.get_primaries()} == set(redis_cluster.masters())  # found from the seeds
    many.set("tg-client-probe", b"1")
    assert redis_cluster.client(redis_cluster.master_of("tg-client-probe")).get("tg-client-probe") == b"1"
    one.close()
    many.close()

    async def main():
        a = async_client(redis_cluster.url, timeout_s=0.5, connect_timeout_s=0.5, max_connections=4)
        b = async_client(redis_server.url, timeout_s=0.5, connect_timeout_s=0.5, max_connections=4)
        assert isinstance(a, AsyncRedisCluster) and isinstance(b, aioredis.Redis)
        assert await a.get("tg-client-probe") == b"1" and await b.ping()
        await a.aclose()
        await b.aclose()

    asyncio.run(main())
