"""What fills the GPU at a run's training peak, beside what the plan's memory model counts.

Trains configurations of `bench/plan_bench.py` through the real trainer with the allocator's history
recorded (bench/memsnap/sitecustomize.py) and prints, per run, the plan's memory terms, the measured
peaks, and the allocations live at the peak grouped by the code that made them (largest first).
Writes them to one JSON file. For a memory term that misses its measurement (docs/planner.md).

    python3 bench/memory_peak.py --set V3 --only gb2 --zero-stage 2 --zero-stage 1 --micro-batch 2 --ckpt 2 \
        --work /tmp/mp --out $OUT/h200-memory-peak.json

A candidate is trained as `dskit train` would run it: one the plan refuses (over its memory limit) is
refused here too, in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import plan_bench  # noqa: E402  (bench/plan_bench.py, beside this script)
import runs  # noqa: E402

#: the recorder's Python stacks slow every allocation: a few steps show the steady peak
STEPS = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", dest="sets", action="append", required=True, choices=sorted(plan_bench.CONFIGS))
    ap.add_argument("--only", default="", help="configurations whose name contains this")
    ap.add_argument("--zero-stage", type=int, action="append", choices=(1, 2, 3), required=True)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--ckpt", type=int, default=0, help="activation checkpointing every N layers (0: off)")
    ap.add_argument(
        "--with", dest="extra", action="append", default=[], help="a spec value (a.b=c) for every run"
    )
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write (rewritten after every run)")
    a = ap.parse_args()
    configs = {n: c for s in a.sets for n, c in plan_bench.CONFIGS[s].items() if a.only in n}
    if not configs:
        ap.error(f"--only {a.only!r} matches no configuration of {', '.join(a.sets)}")
    from dskit.errors import SpecError
    from dskit.plan.build import build_plan
    from dskit.spec import load_spec

    for name, (sets, gpus) in configs.items():  # a bad --with is one line before anything runs or is written
        for stage in a.zero_stage:
            forced = plan_bench._forced(1, a.micro_batch, a.ckpt, False, True, stage)
            every = [*plan_bench.COMMON, *sets, *a.extra, *forced]
            try:
                build_plan(
                    load_spec(
                        sets=plan_bench._resolve(every), flags=plan_bench._flags(gpus, "x", a.work, sets)
                    )
                )
            except SpecError as e:
                ap.error(f"{name}, ZeRO-{stage}: {e}")
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    result = {**runs.header(), "steps": STEPS, "runs": []}
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE / "memsnap"), os.environ.get("PYTHONPATH")])
    )
    for name, (sets, gpus) in configs.items():
        for stage in a.zero_stage:
            forced = plan_bench._forced(1, a.micro_batch, a.ckpt, False, True, stage)
            cand = {"verdict": "memory peak", "overrides": forced}
            tag = f"{name} z{stage} mb{a.micro_batch} ck{a.ckpt}"
            snap = a.work / "snap" / tag.replace(" ", "-")
            shutil.rmtree(snap, ignore_errors=True)  # no file of an earlier invocation is read as this run's
            os.environ["DSKIT_MEMSNAP_OUT"] = str(snap)
            row = plan_bench.run_one(
                tag, [*sets, f"training.steps={STEPS}", *a.extra], gpus, cand, [0], a.work
            )
            ranks = {p.stem: json.loads(p.read_text()) for p in sorted(snap.glob("rank*.json"))}
            result["runs"].append({"row": row, "ranks": ranks})
            a.out.write_text(json.dumps(result, indent=1))
            print(f"== {tag}: plan {row['memory_breakdown']}")
            print(
                f"   measured {row.get('measured', {}).get('peak_reserved_gib')} GiB reserved {row.get('error', '')[-1500:]}"
            )
            for rank, r in ranks.items():
                print(f"   {rank}: " + json.dumps({k: v for k, v in r.items() if k != "live_at_peak"}))
                for x in r["live_at_peak"][:25]:
                    print(f"     {x['gib']:8.3f} GiB x{x['count']:<5} {x['site']}")


if __name__ == "__main__":
    main()
