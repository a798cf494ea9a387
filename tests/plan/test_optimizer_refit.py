"""The optimizer refit (`bench/optimizer_refit.py`, docs/planner.md "The optimizer step at both
widths"): speed.py's constants are what the fit gives on the committed runs, so a new run or a change
to the model that moves the best value fails here until the constant and its docs move with it."""

from __future__ import annotations

from tests.conftest import bench_module

REFIT = bench_module("optimizer_refit")


def test_each_refitted_constant_is_its_grids_best_around_the_committed_value():
    fits = REFIT.refit(near=True)
    assert {name for name, *_ in fits} == set(REFIT.GRIDS)
    assert [(n, f) for n, f, committed, _ in fits if f != committed] == []
