"""The "remote" medium: full prefix blocks shared by every replica that names one Redis.

`tierguard serve --kv-remote-url redis://HOST:PORT[/DB]` adds it below host RAM and the
local disk (lookup order device -> host -> disk -> remote). It is one `ColdMedium`
(media.py): the engine and the connector reach it only through that interface.

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
- Reads and writes run on transfer worker threads, many blocks per round trip (one
  pipeline of MGETs; one pipeline of SETs plus one journal entry). Writes are behind the
  answer only (the connector's write-behind); a read from inside a decode step raises
  `ColdContractViolation` after it is counted.
- Redis down, slow or restarted is never an error to a request: connect and command
  timeouts are `timeout_ms` (low milliseconds), failed calls trip a circuit breaker
  (breaker.py) under which reads and writes fail at once without a round trip, and every
  failure is a miss the contract turns into a recompute. `healthy`/`reason` feed
  /health ("degraded" while Redis cannot be reached); writes stop while the breaker is
  not closed.
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

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from tierguard.common.errors import TierguardError
from tierguard.common.stats import counter, gauge
from tierguard.kv.guard import ColdContractViolation, decode_in_progress
from tierguard.kv.media import Buffer, ColdMedium, KeyedBlocks, MediumContext, register_medium
from tierguard.kv.media import block_format as blk
from tierguard.kv.media.disk.format import as_buffer
from tierguard.kv.media.remote.breaker import CLOSED, CircuitBreaker
from tierguard.kv.media.remote.index import RemoteIndex

log = logging.getLogger("tierguard.kv.remote")
MGET_CHUNK = 32  # keys per MGET; a pipeline carries all chunks of a job in one round trip
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
        breaker: CircuitBreaker | None = None,
    ) -> None:
        if ttl_s <= 0 or timeout_ms <= 0 or refresh_s <= 0 or capacity_bytes <= 0:
            raise TierguardError("remote KV tier: ttl, timeout, refresh and budget must be positive")
        self.url = url
        self.fingerprint = fingerprint
        self.codec = codec
        self.capacity_bytes = int(capacity_bytes)
        self.stored_bytes = blk.HEADER_LEN + codec.stored_len(block_bytes)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.refresh_s = refresh_s
        self._prefix = f"{namespace}:{fingerprint}:"
        self.breaker = breaker or CircuitBreaker()
        timeout = timeout_ms / 1000.0
        # No client-side retries: the breaker decides when to try again.
        try:
            self.client = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
            )
        except ValueError as e:
            raise TierguardError(f"remote KV tier: bad url {url!r}: {e}") from None
        self.index = RemoteIndex(self.client, self._prefix + "journal", self.ttl_ms, self.stored_bytes)
        self._lock = threading.Lock()
        self._c = dict.fromkeys(_COUNTERS, 0)
        self._stop = threading.Event()
        self._refresh()  # learn what the fleet wrote (and Redis' state for /health) before serving
        self._thread = threading.Thread(target=self._refresh_loop, name="kv-remote-refresh", daemon=True)
        self._thread.start()

    # ---- state for the manager and /health ----

    @property
    def healthy(self) -> bool:  # type: ignore[override]
        return not self.breaker.failing

    @property
    def writes_enabled(self) -> bool:  # type: ignore[override]
        return self.breaker.state == CLOSED

    @property
    def reason(self) -> str:  # type: ignore[override]
        if not self.breaker.failing:
            return ""
        return f"redis unreachable ({self.breaker.state}): {self.breaker.last_error}"

    def key(self, block_hash: int) -> str:
        return f"{self._prefix}{block_hash:064x}"

    def contains(self, block_hash: int) -> bool:
        """Index lookup only (no network), so it is safe anywhere, including inside decode."""
        return self.index.contains(block_hash)

    # ---- calls to Redis, through the breaker ----

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._c[name] += n

    def _call(self, fn) -> tuple[str, Any]:
        """One round trip through the breaker: ("ok", value), ("refused", None) when the
        breaker is open (no round trip), or ("failed", None) (counted, breaker told)."""
        if not self.breaker.allow():
            return "refused", None
        try:
            out = fn()
        except (RedisConnectionError, RedisTimeoutError) as e:
            self.breaker.failure(f"{type(e).__name__}: {e}")
            self._count(errors=1)
            return "failed", None
        except RedisError as e:  # an error reply: Redis is there, this call failed
            self.breaker.success()
            self._count(errors=1)
            log.warning("remote KV tier: %s: %s", type(e).__name__, e)
            return "failed", None
        except BaseException:
            self.breaker.failure("unexpected error")  # never leave a probe outstanding
            raise
        self.breaker.success()
        return "ok", out

    # ---- writes (transfer worker threads, behind the answer) ----

    def write_many(self, items: list[tuple[int, Buffer]]) -> list[bool]:
        """Store blocks with one pipeline: a SET (with TTL) per block, one journal entry for
        the fleet, and the deletions our budget needs. Leading blocks go first: when the
        budget cannot take them all, the tail of the prefix is refused."""
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
        victims = self.index.make_room(len(todo) * self.stored_bytes, self.capacity_bytes)
        values = [(i, h, self._encode(h, as_buffer(p))) for i, h, p in todo]

        def send() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for _, h, value in values:
                pipe.set(self.key(h), value, px=self.ttl_ms)
            if victims:
                pipe.delete(*[self.key(h) for h in victims])
            self.index.announce(pipe, [h for _, h, _ in values], victims)
            return pipe.execute(raise_on_error=False)

        status, replies = self._call(send)
        if replies is None:
            self.index.unmark(victims)
            self._count(
                rejected_writes=refused + (len(todo) if status == "refused" else 0),
                unavailable=len(todo) if status == "refused" else 0,
                write_errors=len(todo) if status == "failed" else 0,
            )
            return results
        stored = [(i, h, len(v)) for (i, h, v), reply in zip(values, replies, strict=False) if reply is True]
        for i, _, _ in stored:
            results[i] = True
        self.index.add_own([h for _, h, _ in stored])
        self._count(
            writes=len(stored),
            write_bytes=sum(n for _, _, n in stored),
            write_errors=len(todo) - len(stored),
            rejected_writes=refused,
            evictions=len(victims),
        )
        return results

    def _encode(self, block_hash: int, payload: memoryview) -> bytes:
        stored = self.codec.encode(payload, blk.associated_data(self.fingerprint, block_hash))
        header = blk.encode_header(blk.header_for(self.fingerprint, block_hash, stored, self.codec))
        return b"".join((header, stored))

    # ---- reads (transfer worker threads, when a stage of work begins) ----

    def read_many(self, items: list[tuple[int, Buffer]]) -> list[bool]:
        """Fetch blocks with one pipeline of MGETs and check each against its header."""
        if decode_in_progress():
            self._count(reads_in_decode=len(items))
            raise ColdContractViolation(
                f"remote tier read ({len(items)} block(s)) attempted inside a decode step"
            )
        if not items:
            return []
        keys = [self.key(h) for h, _ in items]

        def fetch() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for i in range(0, len(keys), MGET_CHUNK):
                pipe.mget(keys[i : i + MGET_CHUNK])
            return [v for chunk in pipe.execute() for v in chunk]

        status, values = self._call(fetch)
        if values is None:
            self._count(misses=len(items), unavailable=len(items) if status == "refused" else 0)
            return [False] * len(items)
        results, gone, corrupt = [], [], []
        why = {"expired": 0, "corrupt": 0, "undecodable": 0, "verify_mismatch": 0}
        read_bytes = 0
        for (h, out), value in zip(items, values, strict=True):
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
            self._call(lambda: self._forget(corrupt))
        self._count(misses=len(gone), read_bytes=read_bytes, **why)
        return results

    def _forget(self, hashes: list[int]) -> None:
        """Delete blocks in Redis and tell the other replicas."""
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(*[self.key(h) for h in hashes])
        self.index.announce(pipe, [], hashes)
        pipe.execute()

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

    # ---- the refresh thread: learn what other replicas wrote ----

    def _refresh(self) -> None:
        if self.breaker.failing:
            self.index.check_identity = True  # Redis may come back empty: compare run ids
        _, result = self._call(self.index.refresh)
        if result is not None:
            learned, forgotten, reset = result
            self._count(refreshes=1, learned=learned, forgotten=forgotten, index_resets=int(reset))
        self.index.expire()

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
        self.client.close()

    def stats(self) -> RemoteTierStats:
        known = len(self.index)
        with self._lock:
            c = dict(self._c)
        return RemoteTierStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=known * self.stored_bytes,
            num_blocks=known,
            breaker_opened=self.breaker.opened,
            breaker_open=self.breaker.state != CLOSED,
            healthy=self.healthy,
            writes_enabled=self.writes_enabled,
            reason=self.reason,
            **c,
        )


def _create(ctx: MediumContext, options: Mapping[str, Any]) -> RemoteTier:
    """Options: `url` (required), `capacity_bytes`, `ttl_s`, `timeout_ms`, `refresh_s`, `namespace`."""
    if not options.get("url"):
        raise TierguardError("the remote KV medium needs a url (--kv-remote-url redis://HOST:PORT[/DB])")
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
