"""A resharded resume on the GPU's optimizer path: does the universal copy carry Adam's state?

The CPU tests (tests/train/test_reshard.py) resume across world and EP sizes, but on the CPU the optimizer is
torch's AdamW; on a GPU ZeRO-3 runs DeepSpeed's FusedAdam and ZeRO-1/2 torch's fused AdamW, each with
its own step counter. One GPU cannot change the world size, so this script forces the universal path at
the same layout: the copy of a checkpoint records another EP size in its dskit.json (the files are the
run's own; only dskit's trigger changes), and the resumed run must continue the uninterrupted one.
For scale, the same checkpoint is also resumed as it is (the plain path). On the CPU a resume without
the Adam moments missed the curve by 7e-3 one step later, and DeepSpeed's shared step counter by 2e-3
two steps later (tests/train/test_reshard.py).

    python bench/reshard_check.py --gpu h200-141gb --out results/h200-reshard-DATE.json --work /tmp/rs
    python bench/reshard_check.py --gpu cpu --out /tmp/rs.json --work /tmp/rs       # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import runs  # noqa: E402  (bench/runs.py, beside this script)

STEPS, AT = 12, 4


def render(label: str, gpu: str, model: str, sets: list[str], work: Path) -> Path:
    from dskit.render.run_dir import render_run
    from dskit.spec import load_spec

    common = [
        f"training.steps={STEPS}",
        "training.log_every=1",
        "training.seq_len=1024",
        "training.global_batch=8",
        f"checkpoint.every={AT}",
        "checkpoint.keep=100",
        "training.lr=1e-3",
    ]
    flags = {
        "hardware.gpu": gpu,
        "hardware.gpus_per_node": 1,
        "model.preset": model,
        "runtime.kind": "none",
        "storage.root": str(work / "storage" / label),
        "name": label,
    }
    return render_run(load_spec(sets=[*common, *sets], flags=flags), "slurm", work / label).out


def ckpt_dir(rd: Path) -> Path:
    from dskit.plan.schema import load_plan

    return Path(load_plan(rd / "run.yaml").run.checkpoint_dir)


def losses(rd: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in runs.step_records(rd)}


def resumed_copy(base: Path, label: str, gpu: str, model: str, sets: list[str], work: Path, how: str) -> Path:
    """A run whose checkpoint dir holds base's step-AT tag: as it is, or marked as of another EP size
    (the universal path)."""
    rd = render(label, gpu, model, sets, work)
    tag = ckpt_dir(rd) / f"step{AT:08d}"
    shutil.copytree(ckpt_dir(base) / tag.name, tag)
    if how == "universal":
        done = json.loads((tag / "dskit.json").read_text())
        done["layout"]["ep_size"] = done["layout"].get("ep_size", 1) + 1
        (tag / "dskit.json").write_text(json.dumps(done, indent=1))
    return rd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", default="h200-141gb")
    ap.add_argument(
        "--model", default="tiny-v2", help="catalog model (small: the point is the optimizer path)"
    )
    ap.add_argument("--stages", default="3,2", help="ZeRO stages to check, comma-separated")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    args = ap.parse_args()
    from dskit import catalog
    from dskit.errors import SpecError

    parts = [s.strip() for s in args.stages.split(",")]
    stages = [int(s) for s in parts if s in ("1", "2", "3")]
    if len(stages) != len(parts):
        ap.error(f"--stages: {args.stages!r}; each one of 1, 2, 3")
    for flag, check in (
        ("--gpu", lambda: catalog.gpu(args.gpu)),
        ("--model", lambda: catalog.model(args.model)),
    ):
        try:
            check()
        except SpecError as e:
            ap.error(f"{flag}: {e.message}")
    args.work.mkdir(parents=True, exist_ok=True)
    result = {**runs.header(), "steps": STEPS, "resumed_at": AT, "rows": []}
    print(
        f"{'ZeRO':>4} {'optimizer step':>15} {'resume':>10} {'max rel. diff after':>20} {'step ' + str(AT + 1):>10}"
    )
    for stage in stages:
        sets = [f"overrides.zero_stage={stage}"]
        base = render(f"z{stage}-base", args.gpu, args.model, sets, args.work)
        runs.train(base)
        want = losses(base)
        from dskit.plan.schema import load_plan

        step_kind = load_plan(base / "run.yaml").parallel.optimizer_step
        for how in ("plain", "universal"):
            rd = resumed_copy(base, f"z{stage}-{how}", args.gpu, args.model, sets, args.work, how)
            log = runs.train(rd)
            if how == "universal" and "resharding" not in log:
                raise SystemExit(f"z{stage}: the universal path was not taken:\n{log[-3000:]}")
            got = losses(rd)
            diffs = {s: abs(got[s] - want[s]) / want[s] for s in got}
            row = {
                "zero_stage": stage,
                "optimizer_step": step_kind,
                "resume": how,
                "steps": sorted(got),
                "max_rel_diff": max(diffs.values()),
                "rel_diff_by_step": {str(s): round(d, 7) for s, d in sorted(diffs.items())},
                "losses": {str(s): got[s] for s in sorted(got)},
                "uninterrupted": {str(s): want[s] for s in sorted(want)},
            }
            result["rows"].append(row)
            print(f"{stage:>4} {step_kind:>15} {how:>10} {row['max_rel_diff']:>20.2e} {diffs[AT + 1]:>10.2e}")
            shutil.rmtree(ckpt_dir(rd), ignore_errors=True)
        shutil.rmtree(ckpt_dir(base), ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
