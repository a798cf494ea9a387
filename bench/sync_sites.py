"""Where a dskit step synchronises the host with the GPU: each synchronising CUDA call, by the Python stack
that made it, per training step.

torch's sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`) warns at every call that waits for the
device (`.item()`, `.tolist()`, a blocking copy, `torch.cuda.synchronize`); bench/sync_hook/sitecustomize.py
counts those warnings by stack in every process of the run. A profile (peer_bench.py --profile) says how
many syncs a step makes and how long they block; this says which lines make them. Two limits: a sync made
by a C++ autograd kernel in the backward is counted at the `backward()` call, not at the op; and `per_step`
divides the whole run's count (start-up and the compiler's warm-up included) by its steps, so read the
per-step sites from their stacks, and the run's tokens/s, slowed by the hook, is no throughput figure.
Run on the GPU machine:

    python3 bench/sync_sites.py --shape "L3 s4096 mb1" --gpu h100-80gb --out $OUT/h100-sync-sites-DATE.json --work /tmp/ss
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import peer_bench, runs, train_bench  # noqa: E402

HOOK = Path(__file__).resolve().parent / "sync_hook"


def sites(shape: str, sets: list[str], work: Path) -> dict:
    """Train the host-bound shape once with the hook on; its sync sites, counted per training step."""
    _, layers, seq, gb, mb = next(x for x in peer_bench.HOST_BOUND if x[0] == shape)
    counts = work / "counts" / shape.replace(" ", "-")
    counts.mkdir(parents=True, exist_ok=True)
    spec_sets = [f"model.num_layers={layers}", f"training.seq_len={seq}", f"training.global_batch={gb}"]
    spec_sets += [f"overrides.micro_batch={mb}", *sets]
    path = os.pathsep.join(x for x in (str(HOOK), os.environ.get("PYTHONPATH")) if x)
    env = {"PYTHONPATH": path, "DSKIT_SYNC_SITES": str(counts)}
    row = train_bench.run_dskit(f"sync sites {shape}", spec_sets, {}, work / "dskit", 1, env=env)
    steps = next(
        int(s.split("=")[1])
        for s in reversed([*train_bench.BASE, *spec_sets])
        if s.startswith("training.steps=")
    )
    total: dict[str, int] = {}
    for f in counts.glob("*.json"):
        for stack, n in json.loads(f.read_text()).items():
            total[stack] = total.get(stack, 0) + n
    ranked = sorted(total.items(), key=lambda kv: -kv[1])
    return {
        "shape": shape,
        "sets": sets,
        "steps": steps,
        "tok_s_gpu": row.get("tok_s_gpu"),
        "error": row.get("error"),
        "syncs_per_step": round(sum(total.values()) / steps, 2),
        "sites": [{"per_step": round(n / steps, 2), "calls": n, "stack": s.splitlines()} for s, n in ranked],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", required=True, choices=[x[0] for x in peer_bench.HOST_BOUND])
    ap.add_argument("--gpu", default=train_bench.GPU, help="the GPU's catalog profile")
    ap.add_argument("--set", action="append", default=[], help="a spec --set for every row")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    a = ap.parse_args()
    train_bench.GPU = a.gpu
    result = {**runs.header(), "rows": []}
    for shape in a.shape:
        row = sites(shape, a.set, a.work)
        result["rows"].append(row)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(
            f"\n{shape}: {row['syncs_per_step']} synchronising calls a step ({row['steps']} steps), {row['tok_s_gpu']} tokens/s"
        )
        for s in row["sites"][:25]:
            print(
                f"  {s['per_step']:6.2f}/step  "
                + "  <-  ".join(x.rsplit("/", 1)[-1] for x in reversed(s["stack"][-5:]))
            )
        if row["error"]:
            print(row["error"][-2000:])


if __name__ == "__main__":
    main()
