"""The optimizer refit (`bench/optimizer_refit.py`, docs/planner.md "The optimizer step at both
widths"): speed.py's constants are what the fit gives on the committed runs, so a new run or a change
to the model that moves the best value fails here until the constant and its docs move with it.
The refit is the bench script's own, imported: what its self-test, `--check`, runs."""

from __future__ import annotations

from bench import optimizer_refit


def test_each_refitted_constant_is_its_grids_best_around_the_committed_value():
    """`--check`: each grid only around speed.py's value; every constant of its GRIDS refitted and none
    differing from speed.py's (exit 1, the table's DIFFERS, where one does)."""
    fits = optimizer_refit.refit(True)
    assert {name for name, *_ in fits} == set(optimizer_refit.GRIDS)
    assert [(name, fitted, committed) for name, fitted, committed, _ in fits if fitted != committed] == []
