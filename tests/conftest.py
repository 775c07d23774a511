"""Fixtures every test package may use, and the CI guard (tests/needs.py).

`redis_server`: a private real `redis-server` (Debian package) on a free loopback port
with a temporary directory, stopped after the test; `.kill()` is SIGKILL, `.restart()`
brings it back empty on the same port. Skips, naming the package, when it is missing
(`make test` installs it when run as root); under `CI=true` the run fails at start instead.

`redis_cluster`: one real Redis Cluster (3 masters, 3 replicas: tierguard/common/
redis_cluster.py) for the whole session, started on first use. Tests share it, so each
uses its own key names, and may pause a node (SIGSTOP) briefly but never kill one: its
`cluster-node-timeout` is long, so no pause turns into a failover. A test that kills a
master starts its own cluster with a short node timeout (`failover_cluster`).
"""

from __future__ import annotations

import pytest

from tests.needs import (  # noqa: F401  (pytest hooks: the CI guard)
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_terminal_summary,
    redis_problem,
)
from tierguard.common.redis_cluster import LocalCluster, cluster_problem
from tierguard.common.redis_server import RedisServer


@pytest.fixture
def redis_server():
    problem = redis_problem()
    if problem:
        pytest.skip(problem)
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster():
    problem = redis_problem() or cluster_problem()
    if problem:
        pytest.skip(problem)
    with LocalCluster(node_timeout_ms=20000) as cluster:
        yield cluster


@pytest.fixture
def failover_cluster():
    """A cluster of its own whose replicas take over 1.5 s after their master stops answering."""
    problem = redis_problem() or cluster_problem()
    if problem:
        pytest.skip(problem)
    with LocalCluster(node_timeout_ms=1500) as cluster:
        yield cluster
