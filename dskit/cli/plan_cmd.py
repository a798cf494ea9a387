"""`dskit plan` and `dskit render`: a spec's plan, printed or written out as a run directory."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from dskit.cli.args import Subparsers, add_spec_args, spec_from_args
from dskit.errors import SpecError
from dskit.host.extras import require


def cmd_plan(a: argparse.Namespace) -> int:
    from dskit.plan.build import build_plan_searched
    from dskit.plan.schema import dump_plan

    if a.plot:
        target = Path(a.plot)
        if target.suffix.lower() != ".png":
            raise SpecError("--plot", f"{a.plot}: give a .png file name")
        if target.is_dir():
            raise SpecError("--plot", f"{a.plot} is a directory; give a file name")
        parent = target.resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise SpecError("--plot", f"{parent} is not a writable directory")
        require("plan --plot", "report")
    plan, found = build_plan_searched(spec_from_args(a))
    if a.plot:  # first: a plot that cannot be written fails before anything is printed
        from dskit.plan.explain import plot

        try:
            written = plot(plan, found, Path(a.plot))
        except OSError as e:
            raise SpecError("--plot", f"cannot write {a.plot}: {e.strerror or e}") from None
        print(f"wrote {written}", file=sys.stderr)
    if a.explain:
        from dskit.plan.explain import row_dict, table

        if a.json:
            print(
                json.dumps(
                    {"plan": plan.model_dump(mode="json"), "candidates": [row_dict(r) for r in found.rows]},
                    indent=2,
                )
            )
        else:
            print(table(plan, found))
            for w in plan.warnings:
                print(f"warning: {w}", file=sys.stderr)
    elif a.json:
        print(json.dumps(plan.model_dump(mode="json"), indent=2))
    else:
        print(dump_plan(plan), end="")
        print_summary(plan, stream=sys.stderr)  # stdout is the YAML alone: `dskit plan > run.yaml`
    return 0


def add_plan(sub: Subparsers) -> None:
    s = sub.add_parser(
        "plan",
        help="resolve a spec into the plan (run.yaml) and print it",
        description="Resolve the spec into the plan and print it: run.yaml's YAML on stdout (`dskit plan > "
        "run.yaml`), its one-line summary and warnings on stderr. The planner weighs every ZeRO stage (1, 2, 3; "
        "an FP8 base 1 or 2), EP size, micro-batch x gradient accumulation, activation checkpointing (off, every "
        "2nd layer, every layer) and optimizer offload (off, cpu; with ZeRO-3): each is checked against GPU and "
        "host memory and timed by the step-time model (dskit/plan/speed.py); the fastest that fits wins "
        "(dskit/plan/search.py). --explain shows them all.",
    )
    add_spec_args(s)
    s.add_argument(
        "--json", action="store_true", help="print JSON instead of YAML (with --explain: plan + candidates)"
    )
    s.add_argument(
        "--explain",
        action="store_true",
        help="print every candidate: memory breakdown, predicted step time, tokens/s/GPU, MFU, why it lost",
    )
    s.add_argument("--plot", metavar="FILE.png", help="draw the candidates' memory and predicted throughput")
    s.set_defaults(func=cmd_plan)


def print_summary(plan: Any, out_dir: Path | None = None, stream: TextIO | None = None) -> None:
    """The plan's warnings (stderr) and one-line summary (`stream`, default stdout)."""
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if out_dir:
        print(f"wrote {out_dir}")
    print(plan.summary(), file=stream or sys.stdout)


def cmd_render(a: argparse.Namespace) -> int:
    from dskit.render.run_dir import render_run

    run = render_run(spec_from_args(a), a.target, a.output, force=a.force, spec_file=a.spec)
    print_summary(run.plan, run.out)
    for step in run.next_steps():
        print(step.line())
    return 0


def add_render(sub: Subparsers) -> None:
    s = sub.add_parser(
        "render",
        help="write a run directory for a target",
        description="Resolve the spec and write run.yaml, deepspeed.json and the target's files "
        "into a new directory (atomically: all files or none).",
    )
    from dskit.render import TARGETS

    s.add_argument(
        "target",
        choices=list(TARGETS),
        help="; ".join(f"{t.name}: {t.help}" for t in TARGETS.values()),
    )
    add_spec_args(s)
    s.add_argument("-o", "--output", help="run directory to create (default: runs/NAME-TARGET)")
    s.add_argument("--force", action="store_true", help="replace an existing run directory")
    s.set_defaults(func=cmd_render)
