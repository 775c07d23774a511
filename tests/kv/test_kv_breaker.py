"""The circuit breaker of the remote tier: opens after failures in a row, lets one probe
through after the cool-down, doubles the cool-down when the probe fails."""

from __future__ import annotations

import pytest

from tierguard.kv.media.remote.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_opens_after_failures_in_a_row_and_a_success_resets_the_count():
    b = CircuitBreaker(failures_to_open=3, open_s=1.0, clock=Clock())
    b.failure("refused")
    b.failure("refused")
    assert b.state == CLOSED and b.failing and b.allow()
    b.success()
    assert not b.failing
    b.failure("refused")
    b.failure("refused")
    assert b.state == CLOSED  # the success restarted the count
    b.failure("timeout")
    assert b.state == OPEN and b.opened == 1 and b.last_error == "timeout"
    assert not b.allow()


def test_one_probe_after_the_cool_down_then_closed_or_open_for_longer():
    clock = Clock()
    b = CircuitBreaker(failures_to_open=1, open_s=1.0, max_open_s=3.0, clock=clock)
    b.failure("refused")
    clock.t += 0.99
    assert not b.allow()
    clock.t += 0.02
    assert b.allow()  # the probe
    assert b.state == HALF_OPEN and not b.allow()  # nobody else while it is out
    b.failure("refused")  # the probe failed: open for twice as long
    clock.t += 1.5
    assert not b.allow()
    clock.t += 0.6
    assert b.allow()
    b.failure("refused")
    clock.t += 3.01  # capped at max_open_s (would be 4 s)
    assert b.allow()
    assert b.success() is True  # closed again; the cool-down starts over
    assert b.state == CLOSED and not b.failing and b.opened == 1
    b.failure("refused")
    clock.t += 1.01
    assert b.allow()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        CircuitBreaker(failures_to_open=0)
    with pytest.raises(ValueError):
        CircuitBreaker(open_s=2.0, max_open_s=1.0)
