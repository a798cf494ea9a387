"""`dskit calibrate`: measure the cluster the plan runs on, as a short job launched like a run."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dskit.cli.args import Subparsers, add_spec_args, count, spec_from_args, spec_words
from dskit.errors import SpecError
from dskit.host.extras import require

if TYPE_CHECKING:
    from dskit.render import Step

LOCAL = "local"


def cmd_calibrate(a: argparse.Namespace) -> int:
    from dskit.calibrate.measures import calibration_name
    from dskit.plan.build import build_calibration_plan
    from dskit.render.run_dir import render_run

    if a.target == LOCAL:  # it trains here: refused before its run directory is written
        require("calibrate local", "train")
    if a.candidates and a.target != LOCAL:
        raise SpecError(
            "--candidates",
            f"trains here, so it runs with `local` only; on {a.target}, render a candidate with "
            "`dskit render` and its overrides.* (the table of `dskit plan --explain`)",
        )
    spec = spec_from_args(a)
    if a.target == LOCAL:
        from dskit.train.local import check_host_gpus

        check_host_gpus(spec.hardware.gpu, spec.hardware.nodes * spec.hardware.gpus_per_node)
    target = "slurm" if a.target == LOCAL else a.target  # local: the same run dir, started here
    out = a.output or f"runs/{calibration_name(spec.name, a.target)}"  # the job's name, as its storage's
    build = functools.partial(build_calibration_plan, target=a.target)
    run = render_run(spec, target, out, force=a.force, spec_file=a.spec, build=build)
    c = run.plan.calibrate
    assert c is not None  # build_calibration_plan always adds it
    shapes = ", ".join(f"{g.key} ({g.role})" for g in c.groups) or "none (one rank)"
    exchanges = ", ".join(f"{x.key} (EP {x.ep_size})" for x in c.exchanges) or "none"
    print(
        f"wrote {run.out}: a calibration job for {run.plan.hardware.nodes}x{run.plan.hardware.procs_per_node} "
        f"{run.plan.hardware.gpu}; groups: {shapes}; AutoEP exchanges: {exchanges}"
    )
    if a.target != LOCAL:
        for step in [*run.next_steps(), _plan_with("then", c.file, a)]:
            print(step.line())
        return 0
    from dskit.calibrate import candidates as candidate_runs
    from dskit.train.local import run_local

    # a report left by an earlier calibration there describes that one: gone before this one is measured
    candidate_runs.report_path(Path(c.file)).unlink(missing_ok=True)
    code = run_local(str(run.out))
    if code != 0:
        return code
    if a.candidates:

        def spec_with(extra: list[str], name: str | None = None):
            # the name through its flag: --job-name, where given, takes precedence over --set name=
            named = {"job_name": name} if name else {}
            return spec_from_args(argparse.Namespace(**{**vars(a), "set": [*a.set, *extra], **named}))

        try:
            records = candidate_runs.measure(spec_with, Path(c.file), a.candidates, run.out / "candidates")
        except candidate_runs.CandidateFailed as e:  # a run that failed, not bad input: not exit 2
            sys.stderr.write(f"dskit: calibrate: {e}\n")
            return 1
        print(candidate_runs.table(records))
        print(f"candidates: {candidate_runs.report_path(Path(c.file))}")
    print(f"calibration: {c.file}")
    print(_plan_with("next", c.file, a).line())
    return 0


def _plan_with(label: str, calibration: str, a: argparse.Namespace) -> Step:
    """The step after a calibration: the plan of the same spec and flags at the measured rates."""
    from dskit.render import Step

    words = spec_words(a, leave_out=("calibration",))
    return Step(label, ("dskit", "plan", *words, "--calibration", calibration, "--explain"))


def add_calibrate(sub: Subparsers) -> None:
    from dskit.render import TARGETS

    targets = [LOCAL, *(t for t in TARGETS if t != "image")]
    s = sub.add_parser(
        "calibrate",
        help="measure this cluster's collectives, GEMM and CPU Adam rates for the plan (a short job)",
        description="Render (and with `local`, run) a short job, launched like a training run of the same "
        "spec, that times what the plan's step-time model depends on, on your hardware: all-gather and "
        "reduce-scatter over every process-group shape a plan of this size forms (inside a node, across "
        "nodes, each EP size's expert-data-parallel groups), at sizes around the plan's messages; AutoEP's "
        "own dispatch and combine over each EP group (its count exchange and uneven all-to-alls) at the "
        "token counts the candidates route; the GEMM rate (GPUs and CPU ranks) and the attention rate "
        "(GPUs); the host's cost per layer pass; DeepSpeed's CPU Adam with every rank of a node stepping at "
        "once. Rank 0 writes "
        "calibration.json to the run's output dir (atomically: a killed job leaves none). Give it to "
        "`dskit plan`/`render` with --calibration FILE (spec: hardware.calibration); `--explain` then "
        "names each term's source. A group measuring far below its fabric (NCCL on TCP sockets, a missing "
        "NIC or GPUDirect, a small /dev/shm) is named in one line: a preflight before a long run.",
    )
    s.add_argument(
        "target",
        choices=targets,
        help=f"{LOCAL}: run it here now (torchrun, like `dskit train --local`); "
        + "; ".join(f"{t}: render it as `dskit render {t}` does" for t in targets[1:]),
    )
    add_spec_args(s)
    s.add_argument("-o", "--output", help="run directory to create (default: runs/NAME-calibrate-TARGET)")
    s.add_argument("--force", action="store_true", help="replace an existing run directory")
    s.add_argument(
        "--candidates",
        type=count,
        default=0,
        metavar="N",
        help=f"with {LOCAL}: then train the calibrated plan's top N candidates for a few steps each and "
        "record their measured tokens/s and peak memory beside the predictions in candidates.json, beside "
        "the calibration file (a report for you; the plan reads only the calibration)",
    )
    s.set_defaults(func=cmd_calibrate)
