"""The simulated transfer worker keeps the real one's lanes and store policy on simulated
time (tierguard/kv/transfer.py): write-behind waits for the stores' share of the cores, a
finished sequence's offload never waits for it (but is charged to it), and no store delays
a promotion. Route costs are pinned, so every start and end is known exactly."""

from __future__ import annotations

import pytest

from tierguard.kv.media import DeviceBlocks, HostSlots
from tierguard.kv.store_policy import StorePolicy
from tierguard.kv.transfer import STORE_RETRY_S, TransferSpec
from tierguard.predict.media import ROUTES, MediaCost, RouteCost
from tierguard.predict.simengine import SimClock, SimMedium, SimTransferWorker

WRITE_S, READ_S, OFFLOAD_S = 0.1, 0.01, 0.02  # per block


def worker(share: float = 0.5, burst_s: float = 0.01):
    clock = SimClock()
    routes = {r: RouteCost(0.0, 0.0) for r in ROUTES}
    routes.update(host_to_disk=RouteCost(0.0, WRITE_S), disk_to_host=RouteCost(0.0, READ_S),
                  device_to_host=RouteCost(0.0, OFFLOAD_S))
    disk = SimMedium("disk", 100)
    policy = StorePolicy(max_pending=8, share=share, burst_s=burst_s, clock=clock.monotonic)
    return SimTransferWorker(clock, MediaCost(routes, 4096), [disk], None, 1.0, store_policy=policy), clock, disk


def finish_times(w: SimTransferWorker, clock: SimClock, until: float, step: float = 0.001) -> dict[int, float]:
    """When each job is first reported, stepping the clock as an engine would."""
    out: dict[int, float] = {}
    while clock.now < until:
        for r in w.get_finished():
            out[r.job_id] = clock.now
        clock.sleep(step)
    return out


def test_write_behind_waits_for_the_share_and_promotions_do_not():
    w, clock, disk = worker(share=0.5, burst_s=0.01)
    w.transfer_async(1, TransferSpec(HostSlots([0]), disk.spec([11])), store=True)  # runs at once: 100 ms
    w.transfer_async(2, TransferSpec(HostSlots([1]), disk.spec([12])), store=True)
    w.transfer_async(3, TransferSpec(disk.spec([11]), HostSlots([2])))  # a promotion, submitted last
    done = finish_times(w, clock, 1.0)
    assert done[3] == pytest.approx(READ_S, abs=0.0015)  # not behind either store
    assert done[1] == pytest.approx(WRITE_S, abs=0.0015)
    # store 2: 10 ms banked, 100 ms charged: it waits until 90 ms of debt are repaid at 50 %
    # (180 ms, polled every STORE_RETRY_S), then takes its 100 ms
    assert done[2] >= 0.18 + WRITE_S - 1e-9
    assert done[2] <= 0.18 + STORE_RETRY_S + WRITE_S + 0.0015
    assert w.store_policy.stats().store_deferrals > 0


def test_an_offload_never_waits_for_the_share_but_spends_it():
    w, clock, disk = worker(share=0.5, burst_s=0.01)
    w.store_policy.charge(1.0)  # the share is spent for the next two seconds
    w.transfer_async(1, TransferSpec(DeviceBlocks([0, 1]), HostSlots([0, 1])), store=True, holds_device=True)
    w.transfer_async(2, TransferSpec(HostSlots([0]), disk.spec([11])), store=True)
    done = finish_times(w, clock, 3.0, step=0.005)
    assert done[1] == pytest.approx(2 * OFFLOAD_S, abs=0.006)  # at once: it holds device blocks
    # the write-behind waited for the debt (1 s, plus the offload's 40 ms) at 50 %
    assert done[2] >= 2 * (1.0 + 2 * OFFLOAD_S - 0.01) + WRITE_S - 1e-9


def test_stores_one_at_a_time_on_their_lane():
    w, clock, disk = worker(share=1.0, burst_s=10.0)  # no share limit: only the lane's order
    for j in range(3):
        w.transfer_async(j, TransferSpec(HostSlots([j]), disk.spec([20 + j])), store=True)
    done = finish_times(w, clock, 1.0)
    assert [done[j] for j in range(3)] == pytest.approx([WRITE_S, 2 * WRITE_S, 3 * WRITE_S], abs=0.0015)
    assert all(disk.contains(20 + j) for j in range(3))
