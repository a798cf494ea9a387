"""ZeRO-1/2's optimizer step on one GPU, per parameter: DeepSpeed's three passes against dskit's one.

The question: at micro-batch 1 the step's per-parameter passes were a third of the GPU time. This
times, over flat partitions of N parameters (bf16 gradient and weights, fp32 master and moments):
- `three_passes`: the 16-bit gradient cast to a new fp32 tensor, torch's fused AdamW on it, the master
  copied back into the 16-bit weights (DeepSpeed 0.19.8's stage_1_and_2 step);
- `one_pass`: dskit/train/adamw_cast.py, the kernel torch.compile makes of the same arithmetic.
Both with a clip coefficient and found_inf on the device, as the fused step runs them. Effective GB/s
counts the bytes each must move at least (40 and 28 per parameter); the H200's HBM3e peak is 4.8 TB/s.

    python bench/adamw_cast_bench.py --out bench/results/training/h200-adamw-cast-2026-12-04.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from dskit.train import adamw_cast  # noqa: E402

import runs  # noqa: E402  (bench/runs.py, beside this script)

BYTES = {"three_passes": 40, "one_pass": 28}


def row(n: int, reps: int) -> dict:
    dev = torch.device("cuda")
    master = torch.randn(n, device=dev) * 0.02
    grad16 = torch.randn(n, device=dev, dtype=torch.bfloat16)
    weights = master.to(torch.bfloat16)
    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "fused": True}
    ref_master = master.clone().requires_grad_()
    ref = torch.optim.AdamW([ref_master], **hyper)
    ref.grad_scale, ref.found_inf = torch.ones((), device=dev), torch.zeros((), device=dev)
    one_master = master.clone().requires_grad_()
    one = torch.optim.AdamW([one_master], **hyper)
    del master

    def three_passes():
        ref_master.grad = grad16.to(torch.float32)
        ref.step()
        ref_master.grad = None
        weights.copy_(ref_master.detach())

    def one_pass():
        adamw_cast.step(one, one.param_groups[0], grad16, one_master, weights, ref.grad_scale, ref.found_inf)

    out = {"params": n}
    for name, fn in (("three_passes", three_passes), ("one_pass", one_pass)):
        torch.cuda.reset_peak_memory_stats()
        ms = runs.cuda_median_s(fn, reps, warmup=3) * 1e3
        out[name] = {
            "ms": round(ms, 3),
            "gb_s": round(BYTES[name] * n / ms / 1e6, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        }
    out["speedup"] = round(out["three_passes"]["ms"] / out["one_pass"]["ms"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--params", type=float, nargs="+", default=[0.1e9, 0.5e9, 1.0e9], help="partition sizes")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("adamw_cast_bench: needs a GPU")
    rows = [row(int(n), args.reps) for n in args.params]
    print(
        f"{'params':>14} {'three passes ms':>16} {'GB/s':>7} {'one pass ms':>12} {'GB/s':>7} {'speedup':>8}"
    )
    for r in rows:
        t, o = r["three_passes"], r["one_pass"]
        print(
            f"{r['params']:>14,} {t['ms']:>16.2f} {t['gb_s']:>7.0f} {o['ms']:>12.2f} {o['gb_s']:>7.0f} {r['speedup']:>7.2f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({**runs.header(), "bytes_per_param": BYTES, "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
