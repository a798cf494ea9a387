"""A GPU plan started here (`dskit train --local`, `dskit calibrate local`) on a host without its GPUs: one
line naming hardware.gpu, exit 2, nothing spawned or written, where each of its ranks used to die in
torch.cuda.set_device with a traceback of its own."""

from __future__ import annotations

import torch

from tests.support.cli import cli

LINE = (
    "dskit: error: hardware.gpu: h100-80gb: this run starts 8 ranks on this host, which has no GPU; plan it "
    "for this host (hardware.gpu cpu)"
)
TINY = ["--model", "tiny-v2", "--set", "training.seq_len=128"]


def test_train_local_of_a_gpu_plan_on_this_cpu_host_is_one_line(tmp_path):
    assert not torch.cuda.is_available()  # the premise: CI's machine
    run = tmp_path / "run"
    cli("render", "slurm", "--gpu", "h100-80gb", *TINY, "-o", str(run), check=True)
    before = sorted(p.name for p in run.iterdir())
    r = cli("train", "--local", str(run))
    assert (r.returncode, r.stderr.strip().splitlines()) == (2, [LINE])
    assert sorted(p.name for p in run.iterdir()) == before  # no local-run.json: nothing started


def test_calibrate_local_of_a_gpu_plan_on_this_cpu_host_writes_nothing(tmp_path):
    out = tmp_path / "cal"
    r = cli("calibrate", "local", "--gpu", "h100-80gb", *TINY, "-o", str(out))
    assert (r.returncode, r.stderr.strip().splitlines()) == (2, [LINE])
    assert not out.exists()
