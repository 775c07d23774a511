"""Offload stores under backpressure: a bounded backlog, a bounded share of the cores,
drops counted by kind and reason, promotions never refused."""

from __future__ import annotations

import threading
import time

import pytest

from tierguard.kv.store_policy import OFFLOAD, PERSIST, StorePolicy


def one_block(medium: str) -> type:
    """A block spec of one block on `medium` (routes are named by their media)."""
    from tierguard.kv.media import BlockSpec

    return type(medium.title(), (BlockSpec,), {"medium": medium, "__len__": lambda self: 1})


def test_backlog_bound_drops_and_counts():
    p = StorePolicy(max_pending=2, share=1.0)
    assert p.admit(OFFLOAD) and p.admit(PERSIST)
    assert not p.admit(OFFLOAD) and not p.admit(PERSIST)  # two already waiting or running
    p.done(OFFLOAD, 0.001)
    assert p.admit(OFFLOAD)
    s = p.stats()
    assert s.stores_admitted == {OFFLOAD: 2, PERSIST: 1}
    assert s.stores_dropped == {"offload_backlog": 1, "persist_backlog": 1}
    assert s.stores_pending == 2


def test_share_is_a_budget_of_cpu_seconds():
    t0 = 1000.0
    p = StorePolicy(max_pending=4, share=0.1, burst_s=0.01, clock=lambda: t0)
    assert p.allow_run(t0)
    p.charge(0.05)  # a job that used 50 ms of CPU
    assert not p.allow_run(t0 + 0.1)  # 10 ms of share earned, 40 ms still owed
    assert not p.allow_run(t0 + 0.35)
    assert p.allow_run(t0 + 0.55)  # debt repaid at 10 % of wall time
    assert p.stats().store_deferrals == 2


@pytest.mark.parametrize("kwargs", [{"max_pending": 0}, {"share": 0.0}, {"share": 1.5}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        StorePolicy(**kwargs)


def test_store_lane_waits_for_its_share_and_promotions_do_not(tmp_path):
    """A store queued behind a spent share waits; a promotion submitted after it runs first."""
    from tierguard.kv.transfer import TransferHandler, TransferSpec, TransferWorker

    One, Two = one_block("one"), one_block("two")

    order: list[str] = []

    class Record(TransferHandler):
        def run(self, spec, prepared):
            order.append(spec.route_name)
            return [True]

    policy = StorePolicy(max_pending=4, share=0.5, burst_s=0.01)
    policy.charge(0.2)  # the share is spent for the next ~0.4 s
    worker = TransferWorker(1, num_threads=1, store_policy=policy)
    worker.register_handler(One, Two, Record())
    worker.register_handler(Two, One, Record())
    try:
        worker.transfer_async(1, TransferSpec(One(), Two()), store=True)
        worker.transfer_async(2, TransferSpec(Two(), One()))
        deadline = time.monotonic() + 10
        while len(order) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == ["two_to_one", "one_to_two"]
        assert policy.stats().store_deferrals > 0
    finally:
        worker.shutdown()


def test_shutdown_runs_queued_stores_without_waiting_for_the_share():
    from tierguard.kv.transfer import TransferHandler, TransferSpec, TransferWorker

    A, B = one_block("a"), one_block("b")

    ran = threading.Event()

    class Mark(TransferHandler):
        def run(self, spec, prepared):
            ran.set()
            return [True]

    policy = StorePolicy(max_pending=4, share=0.01)
    policy.charge(100.0)  # would wait hours for its share
    worker = TransferWorker(1, store_policy=policy)
    worker.register_handler(A, B, Mark())
    worker.transfer_async(1, TransferSpec(A(), B()), store=True)
    t0 = time.monotonic()
    worker.shutdown()
    assert ran.is_set() and time.monotonic() - t0 < 5


def test_an_offload_runs_while_write_behind_waits_for_the_share():
    """An offload holds device blocks until it ends: it must not queue behind a write-behind
    waiting for the stores' share (a new request would find no free blocks). It is charged
    to the share all the same."""
    from tierguard.kv.transfer import TransferHandler, TransferSpec, TransferWorker

    Host, Disk, Device = one_block("host"), one_block("disk"), one_block("device")

    order: list[str] = []

    class Record(TransferHandler):
        def run(self, spec, prepared):
            sum(range(20000))  # a little CPU to charge
            order.append(spec.route_name)
            return [True]

    class Charged(StorePolicy):
        charges: list[float] = []

        def charge(self, seconds: float) -> None:
            self.charges.append(seconds)
            super().charge(seconds)

    policy = Charged(max_pending=4, share=0.01)
    StorePolicy.charge(policy, 100.0)  # write-behind would wait hours for its share
    worker = TransferWorker(1, store_policy=policy)
    worker.register_handler(Host, Disk, Record())
    worker.register_handler(Device, Host, Record())
    try:
        worker.transfer_async(1, TransferSpec(Host(), Disk()), store=True)
        worker.transfer_async(2, TransferSpec(Device(), Host()), store=True, holds_device=True)
        deadline = time.monotonic() + 10
        while not order and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert order == ["device_to_host"]
        assert len(policy.charges) == 1  # the offload's CPU went on the stores' account
    finally:
        worker.shutdown()
    assert order == ["device_to_host", "host_to_disk"]
