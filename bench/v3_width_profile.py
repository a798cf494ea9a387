"""Where a ZeRO-1 and a ZeRO-2 step go at DeepSeek-V3's width, on one GPU.

The `V3s L3 s4096 gb2` configuration of `bench/plan_bench.py --set V3` (3 V3 layers with EP 8's 32
experts, one 4,096-token sequence per micro-step, 2 micro-steps), its two ZeRO-1/2 candidates, each
trained through the real trainer with `training.profile_steps=2` (`dskit/train/profile.py`). Prints each
run's step time and its profile.json (kernel time per step by category, the largest kernels), and
copies them to OUT.

    python3 bench/v3_width_profile.py --work /tmp/pp --out $OUT
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_bench  # noqa: E402  (bench/plan_bench.py, beside this script)

CONFIG = "V3s L3 s4096 gb2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder for the profile JSON files")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    sets, gpus = plan_bench.CONFIGS["V3"][CONFIG]
    sets = [*sets, "training.profile_steps=2"]
    for stage in (1, 2):
        cand = {"verdict": "profiled", "overrides": plan_bench._forced(1, 1, 0, False, True, stage)}
        row = plan_bench.run_one(f"prof z{stage}", sets, gpus, cand, [0], a.work)
        print(f"ZeRO-{stage}: step {row.get('measured', {}).get('step_s')} s {row.get('error', '')[-800:]}")
    for p in sorted(a.work.rglob("profile.json")):
        run = p.parent.parent.name
        shutil.copy(p, a.out / f"{run}-profile.json")
        print(run, json.dumps(json.loads(p.read_text()))[:4000])


if __name__ == "__main__":
    main()
