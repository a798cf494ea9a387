"""A stop request (the STOP file, SIGTERM, SIGUSR1) on one rank: there is no peer to agree with, so the
rank decides alone at each step boundary, with no collective and no device round trip
(dskit/train/loop.py StopRequest), and still checkpoints at the first boundary after the request. Two
ranks agreeing through an all-reduce: tests/train/test_train.py and tests/status/test_report.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from dskit.launch.contract import EXIT_REQUEUE, STOP_FILE
from dskit.plan.schema import load_plan
from tests.conftest import render_tiny
from tests.train.test_train import losses, run, start, wait_for_step

pytestmark = pytest.mark.train

STEPS = 12


def test_one_rank_checkpoints_at_the_step_after_the_stop_file_and_resumes(tmp_path):
    rd = render_tiny(tmp_path, "tiny-v2", steps=STEPS, gpus_per_node=1, extra=["checkpoint.every=100"])
    plan = load_plan(rd / "run.yaml")
    stop = Path(plan.run.checkpoint_dir) / STOP_FILE
    p = start(rd, tmp_path / "a.log")
    try:
        wait_for_step(rd, p, 3)
        stop.touch()
        asked_after = max(losses(rd))
        rc = p.wait(timeout=300)
    finally:
        p.kill()
    log = (tmp_path / "a.log").read_text()
    assert rc == EXIT_REQUEUE, log[-3000:]
    stopped = max(losses(rd))
    # the first boundary after the request (the step running when the file appeared may finish first)
    assert asked_after <= stopped <= asked_after + 1 < STEPS, (asked_after, stopped)
    assert (Path(plan.run.checkpoint_dir) / f"step{stopped:08d}" / "dskit.json").is_file()
    assert not stop.exists()
    assert run(rd, tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()[-3000:]
    assert sorted(losses(rd)) == list(range(1, STEPS + 1))
