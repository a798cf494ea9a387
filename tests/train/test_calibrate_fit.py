"""The calibration job's arithmetic (dskit/calibrate/job.py): the latency/bandwidth fit and the
preflight's verdict, on numbers whose answer is known."""

from __future__ import annotations

import pytest

from dskit.calibrate.calibration import BUS_GBS, EXCHANGE
from dskit.calibrate.job import PREFLIGHT_SHARE, fit, preflight
from dskit.plan.schema import CalibrateExchange, CalibrateGroup


def test_the_fit_recovers_latency_and_bandwidth():
    share, latency, gbs = 7 / 8, 30e-6, 200.0
    points = [(b, latency + b * share / (gbs * 1e9)) for b in (2**20, 2**24, 2**28)]
    f = fit(points, share)
    assert f.latency_s == pytest.approx(latency) and f.bus_gbs == pytest.approx(gbs)


def test_noise_that_makes_the_latency_negative_fits_through_the_origin():
    points = [(1_000_000, 0.0001), (2_000_000, 0.0003), (4_000_000, 0.0007)]
    f = fit(points, 1.0)
    assert f.latency_s == 0 and f.bus_gbs > 0


def test_times_that_do_not_grow_with_size_fit_the_files_ceiling_not_a_rate_it_refuses():
    """Latency-bound points (the same time at every size, to the last bit): no measurable bandwidth, so
    the file's ceiling, which the plan reads as free transfers, never a value its reader refuses."""
    f = fit([(2**10, 1e-4), (2**12, 1e-4), (2**14, 1e-4 + 1e-18)], 1.0)
    assert f.bus_gbs == BUS_GBS[1] and f.latency_s == pytest.approx(1e-4)


def _group(expected: float | None) -> CalibrateGroup:
    return CalibrateGroup(
        key="8x2", role="dense: every rank", size=16, stride=1,
        moved_share={"all_gather": 15 / 16}, expected_gbs={"all_gather": expected},
    )  # fmt: skip


def test_the_preflight_names_a_group_far_below_its_fabric():
    slow = fit([(2**20, 1e-3), (2**24, 1.6e-2)], 15 / 16)  # about 1 GB/s where 400 are expected
    lines = preflight([_group(400.0)], [], {"all_gather": {"8x2": slow}})
    assert len(lines) == 1 and lines[0].startswith("all_gather over 8x2 (dense: every rank) measured")
    assert "across nodes" in lines[0] and "NCCL" in lines[0]
    fine = fit([(2**20, 1e-5), (2**30, 1e-5 + 2**30 * 15 / 16 / (PREFLIGHT_SHARE * 1.2 * 400e9))], 15 / 16)
    assert preflight([_group(400.0)], [], {"all_gather": {"8x2": fine}}) == []
    assert preflight([_group(None)], [], {"all_gather": {"8x2": slow}}) == []  # nothing to compare with


def test_the_preflight_names_autoeps_exchange_far_below_the_all_to_all_rate():
    """AutoEP's dispatch and combine, measured over an EP group, beside the catalog's all-to-all rate for
    its shape."""
    x = CalibrateExchange(
        key="8x1", ep_size=8, tokens=[4096], top_k=8, experts=64, hidden=2048, expected_gbs=450.0
    )
    slow = fit([(2**20, 1e-3), (2**24, 1.6e-2)], 7 / 8)
    lines = preflight([], [x], {EXCHANGE: {"8x1": slow}})
    assert len(lines) == 1 and lines[0].startswith(f"{EXCHANGE} over 8x1 (expert-parallel at EP 8) measured")
    assert "inside a node" in lines[0]
