"""`Retry-After` is an estimate of the wait, not any positive number: the time for the
queue ahead (and the refused request itself) to drain through the slots, at the mean
time a slot is held. On virtual time (virtual_time.py) with requests that hold their
slot for a known time, so the true wait is known exactly; the estimate must track it
(within a factor of two) as the service time changes, and a client that comes back when
it says finds a slot sooner than one that comes back at once."""

from __future__ import annotations

import asyncio

import pytest

from tests.gate import virtual_time
from tierguard.gate.admission import AdmissionController, Rejected, RequestInfo
from tierguard.gate.policy import AdmissionPolicy

SLOTS, QUEUE = 2, 4


def controller() -> AdmissionController:
    policy = AdmissionPolicy(max_concurrency=SLOTS, max_queue=QUEUE, max_queue_wait_ms=600_000)
    return AdmissionController(policy, clock=asyncio.get_running_loop().time)


async def serve(c: AdmissionController, n: int, service_s: float) -> None:
    """n requests, each holding its slot for `service_s`: the estimate learns from them."""

    async def one() -> None:
        async with c.admit(RequestInfo(10)):
            await asyncio.sleep(service_s)

    for _ in range(n // SLOTS):  # a wave per slot count: nobody queues, nobody is refused
        await asyncio.gather(*(one() for _ in range(SLOTS)))


async def refused_retry_after(c: AdmissionController, service_s: float) -> tuple[int, list[asyncio.Task]]:
    """Fill the slots and the queue with requests of `service_s`; the next one is refused."""

    async def one() -> None:
        async with c.admit(RequestInfo(10)):
            await asyncio.sleep(service_s)

    busy = [asyncio.create_task(one()) for _ in range(SLOTS + QUEUE)]
    await asyncio.sleep(0)  # every one of them has asked: two run, four wait
    assert c.stats().queued["interactive"] == QUEUE
    with pytest.raises(Rejected) as refused:
        await c.acquire(RequestInfo(10))
    assert refused.value.reason == "queue_full_interactive"
    return refused.value.retry_after_s, busy


@pytest.mark.parametrize("service_s", [0.5, 3.0, 8.0])
def test_retry_after_tracks_the_time_the_queue_ahead_takes(service_s):
    async def main():
        c = controller()
        await serve(c, 60, service_s)
        retry_after, busy = await refused_retry_after(c, service_s)
        # the slots free every service_s; the four queued and the refused one go SLOTS at a time
        wait = service_s * (QUEUE + 1) / SLOTS
        assert max(1.0, wait / 2) <= retry_after <= max(2.0, 2 * wait + 1), (retry_after, wait)
        await asyncio.gather(*busy)

    virtual_time.run(main())


def test_retry_after_follows_a_change_in_service_time():
    async def main():
        c = controller()
        await serve(c, 60, 0.5)
        fast, busy = await refused_retry_after(c, 0.5)
        await asyncio.gather(*busy)
        await serve(c, 60, 10.0)
        slow, busy = await refused_retry_after(c, 10.0)
        await asyncio.gather(*busy)
        assert slow >= 10 * fast  # twenty times the service time: an estimate, not a constant

    virtual_time.run(main())


def test_coming_back_after_retry_after_finds_room_in_the_queue():
    async def main():
        c = controller()
        await serve(c, 60, 3.0)
        retry_after, busy = await refused_retry_after(c, 3.0)
        loop = asyncio.get_running_loop()
        await asyncio.sleep(retry_after)
        t = loop.time()
        ticket = await c.acquire(RequestInfo(10))  # admitted (at once, or after a short wait)
        assert loop.time() - t <= 3.0
        c.release(ticket)
        await asyncio.gather(*busy)

    virtual_time.run(main())
