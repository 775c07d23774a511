"""A private Redis Cluster on loopback: 3 masters and 3 replicas of the Debian `redis-server`.

For tests, benches and manual runs (`make redis-cluster`). Each node is a `RedisServer`
(redis_server.py: its own temporary directory, no persistence, 127.0.0.1 only) started
with `--cluster-enabled yes`; `redis-cli --cluster create ... --cluster-replicas 1` (the
Debian package's own tool, installed with redis-server) assigns the 16,384 slots and the
replicas. `start()` returns once every live node reports `cluster_state:ok` and every
replica's link to its master is up, so a test never races the cluster's own start-up.

    with LocalCluster(node_timeout_ms=1500) as c:
        c.url                       # redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3
        port = c.master_of("key")   # the master that holds this key's slot now
        c.kill(port)                # SIGKILL a node; c.wait_for_failover(port) until a replica took over
        c.pause(port) / c.resume(port)  # SIGSTOP / SIGCONT: a hung shard

Nodes run with `cluster-require-full-coverage no`, the setting docs/fleet.md asks of a
cluster under the remote KV tier: with it, a dead master stops only its own slots, not
the whole cluster, while its replica takes over. `node_timeout_ms` is
`cluster-node-timeout`: how long a master must be unreachable before a replica is
promoted (low in failover tests, high where no test wants a failover).

`python -m tierguard.common.redis_cluster` starts one, prints its URL and stops it on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import time

import redis
from redis.crc import key_slot

from tierguard.common.redis_server import INSTALL_HINT, RedisServer, free_port, redis_server_path

CLI_HINT = "needs redis-cli (Debian package redis-tools, installed with redis-server)"


def cluster_problem() -> str | None:
    """None when a local cluster can be started, else what is missing."""
    if redis_server_path() is None:
        return INSTALL_HINT
    if shutil.which("redis-cli") is None:
        return CLI_HINT
    return None


def _in_span(slot: int, span: str) -> bool:
    """`CLUSTER NODES` slot field: "lo-hi", "n", or "[n->-id]" / "[n-<-id]" (a migration, skipped)."""
    if span.startswith("["):
        return False
    lo, _, hi = span.partition("-")
    return int(lo) <= slot <= int(hi or lo)


class LocalCluster:
    def __init__(self, masters: int = 3, replicas: int = 1, *, node_timeout_ms: int = 5000) -> None:
        if masters < 3 or replicas < 0:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        problem = cluster_problem()
        if problem:
            raise RuntimeError(problem)
        self.masters_wanted = masters
        self.replicas = replicas
        self.node_timeout_ms = int(node_timeout_ms)
        self.nodes: dict[int, RedisServer] = {}
        self.paused: set[int] = set()  # SIGSTOPped: asked nothing until resumed

    # ---- what tests read ----

    @property
    def ports(self) -> list[int]:
        return sorted(self.nodes)

    @property
    def url(self) -> str:
        """Every master at start as a seed: the client finds the rest (and later changes) itself."""
        seeds = ",".join(f"127.0.0.1:{p}" for p in self.ports[: self.masters_wanted])
        return f"redis+cluster://{seeds}"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2.0, socket_connect_timeout=2.0)

    def alive(self) -> list[int]:
        return [p for p, s in self.nodes.items() if s.proc is not None and s.proc.poll() is None]

    def _any(self) -> int:
        """A node that answers: alive and not paused."""
        return next(p for p in self.alive() if p not in self.paused)

    def topology(self, via: int | None = None) -> list[dict]:
        """`CLUSTER NODES` as one live node sees it: port, role, master port, slot ranges, flags."""
        port = via or self._any()
        raw = self.client(port).execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        rows, by_id = [], {}
        for line in text.strip().splitlines():
            f = line.split()
            node_port = int(f[1].split("@")[0].rsplit(":", 1)[1])
            by_id[f[0]] = node_port
            rows.append({"id": f[0], "port": node_port, "flags": f[2].split(","), "master_id": f[3],
                         "slots": f[8:]})
        for r in rows:
            r["role"] = "master" if "master" in r["flags"] else "replica"
            r["master_port"] = by_id.get(r["master_id"])
            r["failed"] = "fail" in r["flags"] or "fail?" in r["flags"]
        return rows

    def masters(self) -> list[int]:
        return sorted(r["port"] for r in self.topology() if r["role"] == "master" and r["slots"]
                      and not r["failed"])

    def keyslot(self, key: str | bytes) -> int:
        return int(self.client(self._any()).execute_command("CLUSTER", "KEYSLOT", key))

    def master_of(self, key: str | bytes) -> int:
        """The port of the master serving `key`'s slot now (as a live node sees it)."""
        return self.master_of_slot(self.keyslot(key))

    def master_of_slot(self, slot: int) -> int:
        for r in self.topology():
            if r["role"] != "master" or r["failed"]:
                continue
            if any(_in_span(slot, span) for span in r["slots"]):
                return r["port"]
        raise LookupError(f"slot {slot} is not served by any master")

    def masters_of(self, keys: list) -> list[int]:
        """The master serving each key now: one `CLUSTER NODES`, slots hashed here (redis-py's
        CRC16, the function `CLUSTER KEYSLOT` runs)."""
        spans = [(r["port"], span) for r in self.topology() if r["role"] == "master" and not r["failed"]
                 for span in r["slots"]]
        out = []
        for key in keys:
            slot = key_slot(key.encode() if isinstance(key, str) else key)
            out.append(next(port for port, span in spans if _in_span(slot, span)))
        return out

    def replica_of(self, master_port: int) -> int:
        for r in self.topology():
            if r["role"] == "replica" and r["master_port"] == master_port:
                return r["port"]
        raise LookupError(f"no replica of {master_port}")

    def _ids(self) -> dict[int, str]:
        return {r["port"]: r["id"] for r in self.topology()}

    def move_slot(self, slot: int, to_port: int, *, finish: bool = True) -> int:
        """Migrate `slot` and its keys to the master on `to_port` the way `redis-cli --cluster
        reshard` does (IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE); returns the old master's
        port. With `finish=False` the keys have moved but the slot is still being migrated:
        the old master answers ASK for them. `finish_move` completes it."""
        src = next(r["port"] for r in self.topology() if r["role"] == "master" and not r["failed"]
                   and any(_in_span(slot, span) for span in r["slots"]))
        ids = self._ids()
        dst_c, src_c = self.client(to_port), self.client(src)
        dst_c.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
        src_c.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[to_port])
        while keys := src_c.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            src_c.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
        if finish:
            self.finish_move(slot, to_port)
        return src

    def finish_move(self, slot: int, to_port: int) -> None:
        dst_id = self._ids()[to_port]
        for port in [to_port] + [p for p in self.masters() if p != to_port]:
            self.client(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        self.wait_ok()

    # ---- faults ----

    def kill(self, port: int) -> None:
        """SIGKILL one node (nothing saved; it stays down until `restart`)."""
        self.nodes[port].kill()

    def pause(self, port: int) -> None:
        """SIGSTOP: the node keeps its sockets but answers nothing (a hung shard)."""
        proc = self.nodes[port].proc
        if proc is not None:
            self.paused.add(port)
            proc.send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        proc = self.nodes[port].proc
        if proc is not None:
            proc.send_signal(signal.SIGCONT)
        self.paused.discard(port)

    def restart(self, port: int, timeout_s: float = 30.0) -> None:
        """Bring a killed node back on its port with its cluster config (it rejoins, empty,
        as a replica when another node took over its slots)."""
        self.nodes[port].start()
        self.wait_ok(timeout_s)

    def wait_for_failover(self, dead_port: int, timeout_s: float = 30.0) -> int:
        """Wait until the slots of `dead_port` are served by another master; returns its port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                for r in self.topology():
                    if r["role"] == "master" and r["slots"] and not r["failed"] and r["port"] != dead_port \
                            and r["port"] not in self._masters_at_start:
                        self.wait_ok(max(1.0, deadline - time.monotonic()))
                        return r["port"]
            except (redis.RedisError, IndexError, OSError):
                pass
            time.sleep(0.02)
        raise TimeoutError(f"no replica took over from {dead_port} within {timeout_s} s")

    # ---- lifecycle ----

    def _node_args(self) -> list[str]:
        # The bus port named, not port + 10000 (which may be taken, or past 65535).
        return ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(free_port()),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-require-full-coverage", "no", "--repl-diskless-sync-delay", "0"]

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        n = self.masters_wanted * (1 + self.replicas)
        try:
            for _ in range(n):
                server = RedisServer(free_port(), extra=self._node_args()).start()
                self.nodes[server.port] = server
            create = ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                      "--cluster-replicas", str(self.replicas), "--cluster-yes"]
            out = subprocess.run(create, capture_output=True, text=True, timeout=timeout_s)
            if out.returncode != 0 or "[OK] All 16384 slots covered" not in out.stdout:
                raise RuntimeError(f"redis-cli --cluster create failed: {(out.stdout + out.stderr)[-800:]}")
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        self._masters_at_start = set(self.masters())
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says `cluster_state:ok`, knows every live node, and every
        live replica's link to its master is up."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                if self._settled():
                    return
            except (redis.RedisError, OSError) as exc:
                last = str(exc)
            time.sleep(0.02)
        raise TimeoutError(f"cluster not settled within {timeout_s} s {last}")

    def _settled(self) -> bool:
        alive = [p for p in self.alive() if p not in self.paused]
        for port in alive:
            c = self.client(port)
            info = c.execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
            rows = self.topology(via=port)
            known = {r["port"] for r in rows if not r["failed"] and "handshake" not in r["flags"]}
            if not set(alive) <= known:
                return False
            me = next(r for r in rows if "myself" in r["flags"])
            if me["role"] == "replica":
                repl = c.info("replication")
                if repl.get("master_link_status") != "up":
                    return False
        return True

    def stop(self) -> None:
        for server in self.nodes.values():
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)  # a paused node cannot handle SIGTERM
            server.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tierguard.common.redis_cluster",
                                description="Start a local Redis Cluster (3 masters, 3 replicas) until Ctrl-C.")
    p.add_argument("--masters", type=int, default=3)
    p.add_argument("--replicas", type=int, default=1, help="replicas per master")
    p.add_argument("--node-timeout-ms", type=int, default=5000, help="cluster-node-timeout (failover delay)")
    a = p.parse_args(argv)
    problem = cluster_problem()
    if problem:
        print(f"redis-cluster: {problem}")
        return 2
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    with LocalCluster(a.masters, a.replicas, node_timeout_ms=a.node_timeout_ms) as c:
        print(f"redis-cluster: {c.url} (masters {c.masters()}, ready in {time.monotonic() - started:.1f} s); "
              "Ctrl-C stops it", flush=True)
        while not stop:
            time.sleep(0.2)
    print("redis-cluster: stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
