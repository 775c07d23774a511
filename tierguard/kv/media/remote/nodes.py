"""Which Redis node holds a key, and one round trip of commands to that node.

The remote tier talks to one node (`redis://`) or to the masters of a Redis Cluster
(`redis+cluster://`, tierguard/common/redis_client.py). Either way it groups the keys of
a job by the node that serves them and sends each node one pipeline, so that each node
has its own circuit breaker (breaker.py): a shard that is down or hung turns only its own
blocks into misses, and the blocks on the other shards still arrive.

What this module promises its caller:
- `route(keys)` maps each key to a node name from the client's own slot map (redis-py's
  `RedisCluster`, which learns the map, follows `MOVED`/`ASK` and re-reads the topology);
  one node: every key to that node. No network unless the cluster client is not yet built.
- `run(node, commands)` sends the commands in one pipeline to that node and returns one
  reply per command; an error reply is returned as its exception (the caller counts it),
  a redirected command is handed to the cluster client, which follows the redirection
  itself. A connection failure, a timeout or `CLUSTERDOWN` raises (the node's breaker
  counts it).
- `refresh()` re-reads the cluster's topology (after a node failed: a replica may have
  taken over its slots); a no-op for one node.
- The cluster client is built lazily: a cluster that cannot be reached when the tier
  starts is an outage like any other (`TOPOLOGY` is the name its failures count under).
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.exceptions import AskError, ClusterDownError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError

from tierguard.common.redis_client import parse_redis_url, sync_client

TOPOLOGY = "cluster"  # the breaker for reaching any seed of a cluster at all


class RedisNodes:
    def __init__(self, url: str, *, timeout_s: float, **options: Any) -> None:
        self.target = parse_redis_url(url)
        self.cluster = self.target.cluster
        self._timeout_s = timeout_s
        self._options = options
        self._lock = threading.Lock()
        self._client: Any = None
        if not self.cluster:
            self._client = sync_client(url, timeout_s=timeout_s, **options)
            parts = urlsplit(url)
            self._name = parts.path if parts.scheme == "unix" else f"{parts.hostname}:{parts.port}"

    @property
    def client(self) -> Any:
        """The client (`redis.Redis` or `RedisCluster`); for a cluster, built on first use.
        Raises `RedisConnectionError` when no seed of the cluster answers."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    try:
                        self._client = sync_client(self.target.url, timeout_s=self._timeout_s, **self._options)
                    except (redis.RedisError, RedisClusterException) as e:
                        raise RedisConnectionError(f"no cluster seed answered: {e}") from None
        return self._client

    def route(self, keys: list[str]) -> dict[str, list[int]]:
        """Node name -> the positions in `keys` it serves."""
        if not self.cluster:
            return {self._name: list(range(len(keys)))}
        client = self.client
        out: dict[str, list[int]] = {}
        try:
            for i, key in enumerate(keys):
                out.setdefault(client.get_node_from_key(key).name, []).append(i)
        except RedisClusterException as e:  # a slot no master serves now
            raise RedisConnectionError(str(e)) from None
        return out

    def node_of(self, key: str) -> str:
        return next(iter(self.route([key])))

    def masters(self) -> list[str]:
        """The nodes that serve slots now, as the client knows them (no network)."""
        if not self.cluster:
            return [self._name]
        if self._client is None:
            return [TOPOLOGY]
        return [n.name for n in self._client.get_primaries()]

    def run(self, node: str, commands: list[tuple]) -> list[Any]:
        if not commands:
            return []
        conn = self.client if not self.cluster else self.client.get_redis_connection(self._node(node))
        pipe = conn.pipeline(transaction=False)
        for args in commands:
            pipe.execute_command(*args)
        replies = pipe.execute(raise_on_error=False)
        for i, reply in enumerate(replies):
            if isinstance(reply, ClusterDownError):
                raise reply  # the node cannot serve its slots: an outage of this node
            if self.cluster and isinstance(reply, AskError):  # MovedError included
                try:
                    replies[i] = self.client.execute_command(*commands[i])
                except redis.ResponseError as e:
                    replies[i] = e
        return replies

    def _node(self, name: str) -> Any:
        node = self.client.get_node(node_name=name)
        if node is None:
            raise RedisConnectionError(f"{name} is no longer in the cluster")
        return node

    def identity(self, key: str) -> tuple[str, str]:
        """(node, run id) of the node that holds `key`: a new run id on the same node means
        that node restarted (empty, without persistence)."""
        if not self.cluster:
            return self._name, str(self.client.info("server").get("run_id", ""))
        node = self._node(self.node_of(key))
        return node.name, str(self.client.info("server", target_nodes=node).get("run_id", ""))

    def refresh(self) -> None:
        if not self.cluster:
            return
        if self._client is None:
            self.client  # noqa: B018 - builds it (reads the topology) or raises
        else:
            self._client.nodes_manager.initialize()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
