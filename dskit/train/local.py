"""`dskit train --local`: run a rendered plan under torchrun on this machine (CPU demo, debugging).

The same entry point and the same launch contract as the cluster targets: the env comes from run.yaml.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dskit.contract import RUN_YAML, STOP_FILE, Env
from dskit.errors import SpecError


def run_file_of(run: str | None) -> Path:
    if not run:
        raise SpecError("run", "give a run directory (from `dskit render`) or its run.yaml")
    p = Path(run)
    f = p / RUN_YAML if p.is_dir() else p
    if not f.is_file():
        raise SpecError("run", f"{f} not found; render one with `dskit render slurm ... -o DIR`")
    return f.resolve()


def run_local(run: str | None, *, nproc: int | None = None) -> int:
    from dskit.plan import load_plan

    run_file = run_file_of(run)
    plan = load_plan(run_file)
    world = plan.hardware.world_size
    if nproc is not None and nproc != world:
        raise SpecError(
            "--nproc",
            f"{nproc} processes, but the plan is for world size {world}: pass --nproc {world} "
            "or re-render with --nodes 1 --gpus-per-node N",
        )
    Path(plan.run.checkpoint_dir, STOP_FILE).unlink(missing_ok=True)  # a stale request would stop us at once
    env = {**os.environ, **plan.env, Env.RUN_FILE.value: str(run_file)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "--max-restarts=0",
        "-m",
        "dskit.train",
    ]
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env).returncode
