"""Fixtures every test package may use, and the CI guard (tests/needs.py).

`redis_server`: a private real `redis-server` (Debian package) on a free loopback port
with a temporary directory, stopped after the test; `.kill()` is SIGKILL, `.restart()`
brings it back empty on the same port. Skips, naming the package, when it is missing
(`make test` installs it when run as root); under `CI=true` the run fails at start instead.
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
