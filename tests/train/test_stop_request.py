"""A stop request (the STOP file, SIGTERM, SIGUSR1) on one rank: there is no peer to agree with, so the
rank decides alone at each step boundary, with no collective and no device round trip
(dskit/train/loop.py StopRequest), and still checkpoints at the first boundary after the request. Two
ranks agreeing through an all-reduce: tests/train/test_train.py and tests/status/test_report.py; and
agreeing a step late, as GPU ranks do, below."""

from __future__ import annotations

import json
import subprocess
import sys
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


AGREE = r"""
import json, sys, torch, torch.distributed as dist
from pathlib import Path
from dskit.train.loop import StopRequest

dist.init_process_group("gloo")
rank, out = dist.get_rank(), {}
for late in (False, True):
    stop = StopRequest(sys.argv[1], rank, torch.device("cpu"))
    stop.late = late  # as on GPUs, where the agreement is read at the next step
    answers = []
    for step in range(1, 7):
        if rank == 1 and step == 3:
            stop.flag = True  # a SIGTERM or SIGUSR1 to rank 1 during step 3
        answers.append(stop.requested())
    out[str(late)] = answers
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(out))
dist.barrier()
dist.destroy_process_group()  # gloo's threads end before the interpreter does
"""


def test_two_ranks_agreeing_a_step_late_stop_together_one_step_later(tmp_path):
    """Rank 1 alone is asked during step 3: at once, both ranks stop after step 3; agreeing a step late
    (the all-reduce read at the next call, as GPU ranks do so as not to wait for the GPU), both stop after
    step 4, never one without the other."""
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    r = subprocess.run([*torchrun, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    answers = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert answers[0] == answers[1]
    assert answers[0]["False"] == [False, False, True, True, True, True]
    assert answers[0]["True"] == [False, False, False, True, True, True]
