"""The model's calibrated terms beyond the step cost: the naive pager's repeat spill
(a block already on disk is not written again)."""

from __future__ import annotations

import pytest

from tierguard.kv.spec import KVLayout
from tierguard.predict.media import ROUTES, MediaCost, RouteCost, measure_media
from tierguard.predict.simengine import SimClock, SimNaiveDisk


def media(spill_ms: float, respill_ms: float, restore_ms: float) -> MediaCost:
    routes = {r: RouteCost(0.0, 0.0) for r in ROUTES}
    routes.update(naive_spill=RouteCost(0.0, spill_ms / 1e3), naive_respill=RouteCost(0.0, respill_ms / 1e3),
                  naive_restore=RouteCost(0.0, restore_ms / 1e3))
    return MediaCost(routes, 1024)


def test_naive_repeat_spill_of_a_block_on_disk_costs_the_measured_repeat():
    clock = SimClock()
    disk = SimNaiveDisk(clock, media(4.0, 0.5, 2.0), None, 1.0)
    for expect_ms, op in [(4.0, disk.spill), (2.0, disk.restore), (0.5, disk.spill), (4.0, lambda h, b: disk.spill(9, b))]:
        before = clock.now
        assert op(7, 0)
        assert (clock.now - before) * 1e3 == pytest.approx(expect_ms)
    assert disk.counters.spills == 3 and disk.counters.restores == 1


def test_a_calibration_without_a_repeat_spill_charges_the_first_spills_time():
    m = media(4.0, 0.5, 2.0)
    del m.routes["naive_respill"]
    assert m.route("naive_respill").per_block_s == pytest.approx(0.004)


def test_media_probe_times_every_route_with_the_tiers_own_classes(tmp_path):
    cost = measure_media(KVLayout(2, 2, 16, 16, "float32"), tmp_path)
    assert set(cost.routes) == set(ROUTES)
    for name in ("naive_spill", "naive_respill", "naive_restore", "host_to_disk"):
        assert cost.routes[name].seconds(1) > 0
