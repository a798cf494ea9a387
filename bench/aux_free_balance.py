"""Auxiliary-loss-free balancing against the balance loss alone, on the CPU: load and loss, over seeds.

The goal: on a tiny V3 started with a skewed routing bias, the bias update brings max/mean expert
load down (tests/train/test_aux_free.py checks 30% against the frozen bias) with the loss no worse than
an auxiliary-loss run within run-to-run noise. Three ways, each over several data seeds (run-to-run
noise: the same start, other batches), 40 steps on 2 gloo ranks (EP 2), the tests' tiny settings:
- aux_free: the bias moves by 0.001 a step, the paper's sequence-wise balance loss 1e-4 beside it;
- aux_loss: the bias frozen at the skew, DeepSeek-V3's published balance loss alone (aux_loss_alpha
  0.001 in its config.json), which must undo the skew through the gate's weights;
- frozen: the bias frozen, no balance loss (the checkpoint's config carries none).
Printed as a table; --out writes the rows as JSON. Measured on 2 CPU cores (2026-12-04, seeds 1-3,
about 20 s a run), mean +- std over seeds of steps 36-40: max/mean load aux_free 2.40 +- 0.14, aux_loss
2.49 +- 0.17, frozen 3.48 +- 0.34; loss 3.023 +- 0.058, 3.031 +- 0.066, 3.021 +- 0.063 (docs/trainer.md).

    python bench/aux_free_balance.py --seeds 1,2,3 --work /tmp/afb --out /tmp/afb/result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import runs  # noqa: E402  (bench/runs.py, beside this script)

STEPS, LAST = 40, 5
#: DeepSeek-V3's config.json: aux_loss_alpha 0.001, seq_aux true
V3_AUX_ALPHA = 1e-3
MODES = {
    "aux_free": ["training.balance=aux_free"],
    "aux_loss": ["training.balance=frozen", f"training.aux_loss_coeff={V3_AUX_ALPHA}"],
    "frozen": ["training.balance=frozen"],
}


def render(label: str, model_path: Path, sets: list[str], seed: int, work: Path) -> Path:
    from dskit.render.run_dir import render_run
    from dskit.spec import load_spec

    common = [
        f"model.path={model_path}",
        f"training.steps={STEPS}",
        f"training.seed={seed}",
        "training.seq_len=128",
        "training.global_batch=8",
        "training.lr=3e-3",
        "training.log_every=1",
        f"checkpoint.every={STEPS}",
    ]
    flags = {
        "hardware.gpu": "cpu",
        "hardware.gpus_per_node": 2,
        "runtime.kind": "none",
        "storage.root": str(work / "storage" / label),
        "name": label,
    }
    return render_run(load_spec(sets=[*common, *sets], flags=flags), "slurm", work / label, force=True).out


def late(recs: list[dict]) -> dict:
    """Over the last LAST steps: max/mean load averaged over layers and steps, and the mean loss
    (cross-entropy, without the balance loss)."""
    last = recs[-LAST:]
    load = [sum(r["expert_load_per_layer"]) / len(r["expert_load_per_layer"]) for r in last]
    return {"load_max_over_mean": statistics.fmean(load), "loss": statistics.fmean(r["loss"] for r in last)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1,2,3", help="data seeds, comma-separated")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds: {args.seeds!r}; give integers, comma-separated")
    from tests.train.test_aux_free import skewed_checkpoint

    args.work.mkdir(parents=True, exist_ok=True)
    start = skewed_checkpoint(args.work / "skewed")
    rows = []
    for mode, sets in MODES.items():
        for seed in seeds:
            rd = render(f"{mode.replace('_', '-')}-s{seed}", start, sets, seed, args.work)
            runs.train(rd)
            rows.append({"mode": mode, "seed": seed, **late(runs.step_records(rd))})
            print(f"{mode:>9} seed {seed}: {rows[-1]}", flush=True)
    summary = {}
    print(f"\n{'mode':>9} {'max/mean load (last 5)':>24} {'loss (last 5)':>22}")
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        s = {
            k: (
                statistics.fmean(r[k] for r in mine),
                statistics.stdev(r[k] for r in mine) if len(mine) > 1 else 0.0,
            )
            for k in ("load_max_over_mean", "loss")
        }
        summary[mode] = {k: {"mean": m, "std": sd} for k, (m, sd) in s.items()}
        load, loss = s["load_max_over_mean"], s["loss"]
        print(f"{mode:>9} {load[0]:>15.3f} +- {load[1]:.3f} {loss[0]:>13.4f} +- {loss[1]:.4f}")
    free, aux = summary["aux_free"]["loss"], summary["aux_loss"]["loss"]
    verdict = {
        "loss_aux_free_minus_aux_loss": free["mean"] - aux["mean"],
        "run_to_run_std": max(free["std"], aux["std"]),
        "load_reduction_vs_frozen": 1
        - summary["aux_free"]["load_max_over_mean"]["mean"] / summary["frozen"]["load_max_over_mean"]["mean"],
    }
    print(json.dumps(verdict, indent=1))
    if args.out:
        result = {**runs.header(), "steps": STEPS, "last_steps": LAST, "seeds": seeds, "rows": rows,
                  "summary": summary, "verdict": verdict}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
