"""Fixtures every test package may use.

`redis_server`: a private real `redis-server` (Debian package) on a free loopback port
with a temporary directory, stopped after the test; `.kill()` is SIGKILL, `.restart()`
brings it back empty on the same port. Skips, naming the package, when it is missing
(`make test` installs it when run as root).
"""

from __future__ import annotations

import pytest

from tierguard.common.redis_server import INSTALL_HINT, RedisServer, redis_server_path


@pytest.fixture
def redis_server():
    if redis_server_path() is None:
        pytest.skip(INSTALL_HINT)
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()
