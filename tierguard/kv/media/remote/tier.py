"""The "remote" medium: full prefix blocks shared by every replica that names one Redis.

`tierguard serve --kv-remote-url redis://HOST:PORT[/DB]` (one node) or
`--kv-remote-url redis+cluster://H1:P1,H2:P2,...` (a Redis Cluster, nodes.py) adds it
below host RAM and the local disk (lookup order device -> host -> disk -> remote). It is
one `ColdMedium` (media.py): the engine and the connector reach it only through that
interface.

What it promises (the cold contract's remote half, docs/cold-contract.md):
- Stored bytes are block_format.py blocks (header, xxh3, the configured `BlockCodec`, so
  an encrypting codec covers remote blocks too), one key per block:
  `<ns>:<fingerprint>:<hash as 64 hex>`, written with a TTL (`ttl_s`). The fingerprint
  names model, dtype, block size and layout, so another model never reads them; the
  header's 256-bit hash must equal the reader's (block_format.py), so a value made from
  other tokens is a counted `verify_mismatch`, deleted, never served.
- `contains` never goes to the network: it asks the local index (remote_index.py) of
  blocks known to be in Redis, filled by this replica's writes and by a background
  refresh of the shared journal (a Redis stream other replicas append to). A load
  confirms: a key that expired or was evicted is a counted miss, dropped from the index.
- Reads and writes run on transfer worker threads, many blocks per round trip: one
  pipeline per node that holds blocks of the job (GETs; SETs, plus one journal entry on
  the journal's node). In a cluster block keys carry no hash tag, so the blocks of a
  prefix spread over every shard. Writes are behind the answer only (the connector's
  write-behind); a read from inside a decode step raises `ColdContractViolation` after
  it is counted.
- Redis down, slow or restarted is never an error to a request: connect and command
  timeouts are `timeout_ms` (low milliseconds), failed calls trip a circuit breaker
  (breaker.py) under which reads and writes fail at once without a round trip, and every
  failure is a miss the contract turns into a recompute. The breaker is per node: in a
  cluster a master that is down or hung costs only the blocks in its slots, and when a
  replica takes them over the blocks are read from it (the refresh thread re-reads the
  topology while a node fails). `healthy`/`reason` feed /health ("degraded" while a
  node serving slots cannot be reached); writes to a node stop while its breaker is not
  closed.
- Budget: Redis enforces its own (`maxmemory` + `maxmemory-policy`, docs); ours counts the
  bytes of the blocks the index knows, and a write that would pass `capacity_bytes`
  first deletes the least recently used ones (and tells the other replicas).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ClusterDownError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tierguard.common.errors import TierguardError
from tierguard.common.redact import redact_text, redact_url
from tierguard.common.stats import counter, gauge
from tierguard.kv.guard import ColdContractViolation, decode_in_progress
from tierguard.kv.media import Buffer, ColdMedium, KeyedBlocks, MediumContext, register_medium
from tierguard.kv.media import block_format as blk
from tierguard.kv.media.disk.format import as_buffer
from tierguard.kv.media.remote.breaker import CLOSED, BreakerSet
from tierguard.kv.media.remote.index import RemoteIndex
from tierguard.kv.media.remote.nodes import TOPOLOGY, RedisNodes

log = logging.getLogger("tierguard.kv.remote")
# A node cannot be reached (or cannot serve its slots): its breaker counts these.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ClusterDownError, RedisClusterException)
_COUNTERS = (
    "misses expired corrupt undecodable verify_mismatch errors unavailable writes write_bytes read_bytes write_errors "
    "rejected_writes evictions learned forgotten refreshes index_resets reads_in_decode"
).split()


@dataclass
class RemoteBlocks(KeyedBlocks):
    medium = "remote"


@dataclass
class RemoteTierStats:
    capacity_bytes: int = gauge(
        "Remote KV tier budget as this replica counts it, bytes.", name="bytes_capacity"
    )
    used_bytes: int = gauge(
        "Bytes of the blocks this replica knows to be in the remote tier.", name="bytes_used"
    )
    num_blocks: int = gauge("Blocks this replica knows to be in the remote tier.", name="blocks")
    hits: int = 0  # blocks read whole (the manager counts tier hits as kv_remote_hits)
    misses: int = counter("Remote blocks asked for and not returned whole (any reason).")
    expired: int = counter("Indexed blocks Redis no longer held (TTL, eviction, restart).")
    corrupt: int = counter("Remote blocks with a bad header or checksum, deleted.")
    undecodable: int = counter("Remote blocks the codec could not decode (e.g. another key); kept.")
    verify_mismatch: int = counter(
        "Remote blocks whose header names another block or model than the reader's tokens (forged or misnamed), deleted."
    )
    errors: int = counter("Redis round trips that failed (refused, timed out, error reply).")
    unavailable: int = counter("Blocks refused without a round trip while the breaker was open.")
    writes: int = counter("Blocks written to the remote tier.")
    write_bytes: int = counter("Bytes written to the remote tier.")
    read_bytes: int = counter("Bytes read from the remote tier.")
    write_errors: int = counter("Blocks whose remote write failed.")
    rejected_writes: int = counter("Writes refused (writes stopped, or larger than the budget).")
    evictions: int = counter("Blocks deleted from Redis to stay within the budget.")
    learned: int = counter("Blocks other replicas wrote, learned from the journal.")
    forgotten: int = counter("Blocks other replicas deleted, dropped from the index.")
    refreshes: int = counter("Journal refreshes that reached Redis.")
    index_resets: int = counter("Index cleared because Redis restarted (a new run id).")
    reads_in_decode: int = counter("Remote reads attempted inside a decode step (refused; a bug).")
    breaker_opened: int = counter("Times the circuit breaker opened (Redis unreachable).")
    breaker_open: bool = gauge("1 while the circuit breaker is open or probing.", default=False)
    healthy: bool = gauge("1 while the remote tier is healthy.", default=True)
    writes_enabled: bool = True
    reason: str = ""


class RemoteTier(ColdMedium):
    name = "remote"
    spec = RemoteBlocks

    def __init__(
        self,
        url: str,
        fingerprint: str,
        block_bytes: int,
        capacity_bytes: int,
        *,
        ttl_s: float = 3600.0,
        timeout_ms: float = 50.0,
        refresh_s: float = 0.25,
        namespace: str = "tgkv",
        codec: blk.BlockCodec = blk.IDENTITY,
        breakers: BreakerSet | None = None,
    ) -> None:
        if ttl_s <= 0 or timeout_ms <= 0 or refresh_s <= 0 or capacity_bytes <= 0:
            raise TierguardError("remote KV tier: ttl, timeout, refresh and budget must be positive")
        self.url = redact_url(url)  # for logs and messages: never the password
        self.fingerprint = fingerprint
        self.codec = codec
        self.capacity_bytes = int(capacity_bytes)
        self.stored_bytes = blk.HEADER_LEN + codec.stored_len(block_bytes)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.refresh_s = refresh_s
        self._prefix = f"{namespace}:{fingerprint}:"
        self.breakers = breakers or BreakerSet()
        # No client-side retries: the breakers decide when to try again.
        try:
            self.nodes = RedisNodes(url, timeout_s=timeout_ms / 1000.0)
        except ValueError as e:
            raise TierguardError(f"remote KV tier: bad url {self.url!r}: {e}") from None
        journal = self._prefix + "journal"
        self.index = RemoteIndex(lambda: self.nodes.client, journal, self.ttl_ms, self.stored_bytes,
                                 identity=lambda: self.nodes.identity(journal))
        self._lock = threading.Lock()
        self._c = dict.fromkeys(_COUNTERS, 0)
        self._stop = threading.Event()
        self._refresh()  # learn what the fleet wrote (and Redis' state for /health) before serving
        self._thread = threading.Thread(target=self._refresh_loop, name="kv-remote-refresh", daemon=True)
        self._thread.start()

    @property
    def client(self) -> Any:
        """The Redis client (one node) or the `RedisCluster` client; raises when a cluster
        cannot be reached yet."""
        return self.nodes.client

    # ---- state for the manager and /health ----

    def _serving(self) -> list[tuple[str, Any]]:
        """The breakers of the nodes that serve slots now (no network)."""
        return [(n, self.breakers[n]) for n in self.nodes.masters()]

    @property
    def healthy(self) -> bool:  # type: ignore[override]
        return not any(b.failing for _, b in self._serving())

    @property
    def writes_enabled(self) -> bool:  # type: ignore[override]
        return any(b.state == CLOSED for _, b in self._serving())

    @property
    def reason(self) -> str:  # type: ignore[override]
        failing = [f"{n} ({b.state}): {redact_text(b.last_error)}" for n, b in self._serving() if b.failing]
        return f"redis unreachable: {'; '.join(failing)}" if failing else ""

    def key(self, block_hash: int) -> str:
        return f"{self._prefix}{block_hash:064x}"

    def contains(self, block_hash: int) -> bool:
        """Index lookup only (no network), so it is safe anywhere, including inside decode."""
        return self.index.contains(block_hash)

    # ---- calls to Redis, through the breaker of the node they go to ----

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._c[name] += n

    def _call(self, node: str, fn) -> tuple[str, Any]:
        """One round trip through `node`'s breaker: ("ok", value), ("refused", None) when the
        breaker is open (no round trip), or ("failed", None) (counted, breaker told)."""
        breaker = self.breakers[node]
        if not breaker.allow():
            return "refused", None
        try:
            out = fn()
        except UNREACHABLE as e:
            breaker.failure(f"{type(e).__name__}: {e}")
            self._count(errors=1)
            return "failed", None
        except RedisError as e:  # an error reply: Redis is there, this call failed
            breaker.success()
            self._count(errors=1)
            log.warning("remote KV tier: %s: %s", type(e).__name__, e)
            return "failed", None
        except BaseException:
            breaker.failure("unexpected error")  # never leave a probe outstanding
            raise
        breaker.success()
        return "ok", out

    def _route(self, keys: list[str]) -> dict[str, list[int]] | None:
        """Node -> positions of `keys`; None when a cluster's topology is out of reach."""
        if not self.nodes.cluster:
            return self.nodes.route(keys)
        _, routes = self._call(TOPOLOGY, lambda: self.nodes.route(keys))
        return routes

    # ---- writes (transfer worker threads, behind the answer) ----

    def write_many(self, items: list[tuple[int, Buffer]]) -> list[bool]:
        """Store blocks: a SET (with TTL) per block and the deletions our budget needs, one
        pipeline per node, then one journal entry for the fleet naming what was stored and
        deleted. Leading blocks go first: when the budget cannot take them all, the tail of
        the prefix is refused. A node whose breaker is not closed gets no writes."""
        results = [self.contains(h) for h, _ in items]  # same (fingerprint, hash): same bytes
        todo = [(i, h, p) for i, (h, p) in enumerate(items) if not results[i]]
        if not todo:
            return results
        fit = self.capacity_bytes // self.stored_bytes
        refused = len(todo) - fit if len(todo) > fit else 0
        if not self.writes_enabled:
            self._count(rejected_writes=len(todo), unavailable=len(todo))
            return results
        todo = todo[: len(todo) - refused]
        if not todo:
            self._count(rejected_writes=refused)
            return results
        journal = self.index.journal_key
        routes = self._route([self.key(h) for _, h, _ in todo] + [journal])
        if routes is None:
            self._count(rejected_writes=refused + len(todo), unavailable=len(todo))
            return results
        node_of = {pos: n for n, positions in routes.items() for pos in positions}
        jnode = node_of[len(todo)]
        open_nodes = {n for n in routes if self.breakers[n].state != CLOSED}
        closed = [(i, h, p) for k, (i, h, p) in enumerate(todo) if node_of[k] not in open_nodes]
        blocked = len(todo) - len(closed)
        victims = self.index.make_room(len(closed) * self.stored_bytes, self.capacity_bytes)
        sets = [(i, h, self._encode(h, as_buffer(p))) for i, h, p in closed]
        stored, deleted = self._store(sets, victims, jnode)
        for i, _, _ in stored:
            results[i] = True
        self.index.add_own([h for _, h, _ in stored])
        self._count(
            writes=len(stored),
            write_bytes=sum(n for _, _, n in stored),
            write_errors=len(sets) - len(stored),
            rejected_writes=refused + blocked,
            unavailable=blocked,
            evictions=len(deleted),
        )
        return results

    def _store(self, sets: list[tuple[int, int, bytes]], victims: list[int], jnode: str
               ) -> tuple[list[tuple[int, int, int]], list[int]]:
        """SET `sets`, DEL `victims`, then announce what landed; returns (stored (i, hash,
        bytes), deleted hashes). The journal's own node goes last, so that its entry names
        only the other nodes' blocks that are really there (its own ride in its pipeline)."""
        ops: dict[str, list[tuple]] = {}
        tags: dict[str, list[tuple[str, Any]]] = {}
        keys = [self.key(h) for _, h, _ in sets] + [self.key(h) for h in victims]
        routes = self._route(keys) or {}
        node_of = {pos: n for n, positions in routes.items() for pos in positions}
        for k, (i, h, value) in enumerate(sets):
            if k in node_of:
                ops.setdefault(node_of[k], []).append(("SET", self.key(h), value, "PX", self.ttl_ms))
                tags.setdefault(node_of[k], []).append(("set", (i, h, len(value))))
        for k, h in enumerate(victims, start=len(sets)):
            if k in node_of:
                ops.setdefault(node_of[k], []).append(("DEL", self.key(h)))
                tags.setdefault(node_of[k], []).append(("del", h))
        stored: list[tuple[int, int, int]] = []
        deleted: list[int] = []
        announced = False
        if jnode not in ops:  # the journal's node holds none of these keys: its entry alone
            ops[jnode], tags[jnode] = [], []
        for node in sorted(ops, key=lambda n: n == jnode):
            n_tagged = len(ops[node])
            if node == jnode:
                puts = [h for _, h, _ in stored] + [ref[1] for kind, ref in tags[node] if kind == "set"]
                dels = deleted + [ref for kind, ref in tags[node] if kind == "del"]
                ops[node] = ops[node] + self.index.announce(puts, dels)
                if not ops[node]:
                    continue
            _, replies = self._call(node, lambda node=node: self.nodes.run(node, ops[node]))
            if replies is None:
                continue
            for (kind, ref), reply in zip(tags[node], replies, strict=False):
                if kind == "set" and reply is True:
                    stored.append(ref)
                elif kind == "del" and not isinstance(reply, Exception):
                    deleted.append(ref)
            if node == jnode and len(replies) > n_tagged:
                announced = not isinstance(replies[n_tagged], Exception)
        gone = set(deleted) if announced else set()
        self.index.unmark([h for h in victims if h not in gone])  # no journal entry will lift these marks
        return stored, deleted

    def _encode(self, block_hash: int, payload: memoryview) -> bytes:
        stored = self.codec.encode(payload, blk.associated_data(self.fingerprint, block_hash))
        header = blk.encode_header(blk.header_for(self.fingerprint, block_hash, stored, self.codec))
        return b"".join((header, stored))

    # ---- reads (transfer worker threads, when a stage of work begins) ----

    def read_many(self, items: list[tuple[int, Buffer]]) -> list[bool]:
        """Fetch blocks, one pipeline of GETs per node, and check each against its header.
        A node that is refused (open breaker) or fails costs only its own blocks."""
        if decode_in_progress():
            self._count(reads_in_decode=len(items))
            raise ColdContractViolation(
                f"remote tier read ({len(items)} block(s)) attempted inside a decode step"
            )
        if not items:
            return []
        keys = [self.key(h) for h, _ in items]
        values: list[Any] = [None] * len(items)
        down: set[int] = set()  # positions whose node was refused or failed: not asked, not a verdict
        unavailable = 0
        routes = self._route(keys)
        if routes is None:
            routes, down = {}, set(range(len(items)))
            unavailable = len(items) if self.breakers[TOPOLOGY].state != CLOSED else 0
        for node, positions in routes.items():
            status, replies = self._call(node, lambda n=node, ps=positions: self.nodes.run(n, [("GET", keys[p]) for p in ps]))
            if replies is None:
                down.update(positions)
                unavailable += len(positions) if status == "refused" else 0
                continue
            for p, reply in zip(positions, replies, strict=True):
                if isinstance(reply, Exception):  # an error reply for this key: a miss, the block stays known
                    down.add(p)
                    self._count(errors=1)
                else:
                    values[p] = reply
        results, gone, corrupt = [], [], []
        why = {"expired": 0, "corrupt": 0, "undecodable": 0, "verify_mismatch": 0}
        read_bytes = 0
        for p, ((h, out), value) in enumerate(zip(items, values, strict=True)):
            if p in down:
                results.append(False)
                continue
            verdict = "expired" if value is None else self._decode(h, value, as_buffer(out))
            results.append(not verdict)
            if verdict:
                why[verdict] += 1
                gone.append(h)
                if verdict in ("corrupt", "verify_mismatch"):
                    corrupt.append(h)
            else:
                read_bytes += len(value)
        self.index.drop(gone)
        self.index.touch([h for (h, _), ok in zip(items, results, strict=True) if ok])
        if corrupt:
            self._forget(corrupt)
        self._count(misses=len(gone) + len(down), unavailable=unavailable, read_bytes=read_bytes, **why)
        return results

    def _forget(self, hashes: list[int]) -> None:
        """Delete blocks in Redis and tell the other replicas."""
        routes = self._route([self.index.journal_key])
        if routes is not None:
            self._store([], hashes, next(iter(routes)))

    def _decode(self, block_hash: int, value: bytes, dst: memoryview) -> str:
        """Empty when `dst` holds the block; else why not: "verify_mismatch" (the value
        names another block or model: made from other tokens), "corrupt" or "undecodable"."""
        mv = memoryview(value)
        try:
            header = blk.decode_header(mv[: blk.HEADER_LEN])
        except blk.BadHeader:
            return "corrupt"
        stored = mv[blk.HEADER_LEN :]
        if not blk.identity_matches(header, self.fingerprint, block_hash):
            return "verify_mismatch"
        if header.codec != self.codec.codec_id:
            return "undecodable"
        if not blk.verify(header, self.fingerprint, block_hash, stored):
            return "corrupt"
        aad = blk.associated_data(self.fingerprint, block_hash)
        return "" if self.codec.decode(stored, aad, dst, header.key_id) else "undecodable"

    # ---- the refresh thread: learn what other replicas wrote; watch the nodes ----

    def _refresh(self) -> None:
        routes = self._route([self.index.journal_key])
        if routes is not None:
            jnode = next(iter(routes))
            if self.breakers[jnode].failing:
                self.index.check_identity = True  # Redis may come back empty: compare run ids
            _, result = self._call(jnode, self.index.refresh)
            if result is not None:
                learned, forgotten, reset = result
                self._count(refreshes=1, learned=learned, forgotten=forgotten, index_resets=int(reset))
        if self.nodes.cluster:
            self._watch_nodes()
        self.index.expire()

    def _watch_nodes(self) -> None:
        """While a node fails: re-read the topology (a replica may have taken its slots over,
        and its blocks come back from there), and probe it when its breaker lets one through,
        so /health recovers without waiting for a read."""
        failing = [n for n, b in self._serving() if b.failing]
        if not failing:
            return
        self._call(TOPOLOGY, self.nodes.refresh)
        for node, breaker in self._serving():
            if breaker.failing and node != TOPOLOGY:
                self._call(node, lambda node=node: self.nodes.run(node, [("PING",)]))

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self._refresh()
            except Exception:  # a bug must not end the refresh (the index would go stale)
                log.exception("remote KV tier: journal refresh failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.nodes.close()

    def stats(self) -> RemoteTierStats:
        known = len(self.index)
        with self._lock:
            c = dict(self._c)
        return RemoteTierStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=known * self.stored_bytes,
            num_blocks=known,
            breaker_opened=self.breakers.opened,
            breaker_open=any(b.state != CLOSED for _, b in self._serving()),
            healthy=self.healthy,
            writes_enabled=self.writes_enabled,
            reason=self.reason,
            **c,
        )


def _create(ctx: MediumContext, options: Mapping[str, Any]) -> RemoteTier:
    """Options: `url` (required), `capacity_bytes`, `ttl_s`, `timeout_ms`, `refresh_s`, `namespace`."""
    if not options.get("url"):
        raise TierguardError("the remote KV medium needs a url (--kv-remote-url redis://HOST:PORT[/DB] "
                             "or redis+cluster://HOST:PORT[,HOST:PORT...])")
    return RemoteTier(
        str(options["url"]),
        ctx.fingerprint,
        ctx.block_bytes,
        int(options.get("capacity_bytes", 1 << 30)),
        ttl_s=float(options.get("ttl_s", 3600.0)),
        timeout_ms=float(options.get("timeout_ms", 50.0)),
        refresh_s=float(options.get("refresh_s", 0.25)),
        namespace=str(options.get("namespace", "tgkv")),
        codec=ctx.codec,
    )


register_medium("remote", _create)
