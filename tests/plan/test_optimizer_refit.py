"""The optimizer refit (`bench/optimizer_refit.py`, docs/planner.md "The optimizer step at both
widths"): speed.py's constants are what the fit gives on the committed runs, so a new run or a change
to the model that moves the best value fails here until the constant and its docs move with it.
The refit is the bench script's own: this runs its self-test, `--check`, as a program."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_each_refitted_constant_is_its_grids_best_around_the_committed_value():
    """`--check`: each grid only around speed.py's value; every constant of its GRIDS refitted and none
    differing from speed.py's (exit 1, the table's DIFFERS, where one does)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "optimizer_refit.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DIFFERS" not in proc.stdout, proc.stdout
