"""GPU probe of where the routed experts' FP8 grouped GEMM spends its time (torchao 0.18's rowwise recipe,
`_to_fp8_rowwise_then_scaled_grouped_mm`, which fp8_gemm_bench.py measured at 0.88x bf16 at V3's width):
each of its eight pieces (five cast kernels: the activations' and the output gradient's row casts, the
weights' two, the per-group cast of both sides of the weight gradient; three scaled grouped GEMMs)
timed alone beside the three bf16 grouped GEMMs they replace, for both of an expert's products (gate+up
fused, down). Prints a table and writes JSON; its recipe and variants are sums of the pieces.

    python3 bench/fp8_experts_probe.py --width v3 --out $OUT/h100-fp8-experts-probe-DATE.json

What it answers: whether FP8 loses in the GEMMs themselves (the forward, the input gradient or the
weight gradient's group-wise contraction over tokens) or in the casts, so which variant could gain
(a weight gradient in bf16, weights cast once per optimizer step).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import runs  # noqa: E402
from bench.fp8_gemm_bench import WIDTHS  # noqa: E402


def pieces(m: int, experts: int, k: int, n: int) -> dict[str, float]:
    """Milliseconds of each piece of one product out[m, n] = x[m, k] @ w_t[e, k, n], groups of m/e rows."""
    from torchao.prototype.moe_training import kernels

    cast_rows = kernels.triton_fp8_rowwise_2d_scale_and_cast  # activations, gradients: a scale per row
    cast_w = kernels.triton_fp8_colwise_3d_scale_and_cast  # weights for the forward
    cast_w_t = kernels.triton_fp8_rowwise_3d_transpose_rhs  # weights for the input gradient
    cast_dual = kernels.triton_fp8_per_group_colwise_scales_dual  # both sides of the weight gradient

    f8 = torch.float8_e4m3fn
    offs = torch.arange(m // experts, m + 1, m // experts, device="cuda", dtype=torch.int32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    go = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    # (e, k, n), column-major per expert as the kernels require
    w_t = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    x8, xs = cast_rows(x, output_dtype=f8, round_scales_to_power_of_2=True)
    w8, ws = cast_w(w_t, output_dtype=f8, round_scales_to_power_of_2=True)
    go8, gos = cast_rows(go, output_dtype=f8, round_scales_to_power_of_2=True)
    wt8, wts = cast_w_t(w_t, output_dtype=f8, round_scales_to_power_of_2=True)
    goc8, gocs, xc8, xcs = cast_dual(go, x, offs, f8, round_scales_to_power_of_2=True)

    def scaled(a, b, sa, sb):
        return torch._scaled_grouped_mm(a, b, sa, sb, offs, out_dtype=torch.bfloat16, use_fast_accum=True)

    timed = {
        "bf16 forward": lambda: torch._grouped_mm(x, w_t, offs=offs),
        "bf16 input grad": lambda: torch._grouped_mm(go, w_t.transpose(-2, -1), offs=offs),
        "bf16 weight grad": lambda: torch._grouped_mm(go.t(), x, offs=offs),
        "cast x rows": lambda: cast_rows(x, output_dtype=f8, round_scales_to_power_of_2=True),
        "cast w": lambda: cast_w(w_t, output_dtype=f8, round_scales_to_power_of_2=True),
        "fp8 forward": lambda: scaled(x8, w8, xs.squeeze(-1).reciprocal(), ws.squeeze(1).reciprocal()),
        "cast grad rows": lambda: cast_rows(go, output_dtype=f8, round_scales_to_power_of_2=True),
        "cast w transposed": lambda: cast_w_t(w_t, output_dtype=f8, round_scales_to_power_of_2=True),
        "fp8 input grad": lambda: scaled(go8, wt8, gos.squeeze(-1).reciprocal(), wts.squeeze(1).reciprocal()),
        "cast grad+x per group": lambda: cast_dual(go, x, offs, f8, round_scales_to_power_of_2=True),
        "fp8 weight grad": lambda: scaled(goc8.t(), xc8, gocs.t().reciprocal(), xcs.reciprocal()),
    }
    return {name: round(runs.cuda_median_s(fn) * 1e3, 4) for name, fn in timed.items()}


def summary(ms: dict[str, float]) -> dict[str, float]:
    bf16 = ms["bf16 forward"] + ms["bf16 input grad"] + ms["bf16 weight grad"]
    gemms = ms["fp8 forward"] + ms["fp8 input grad"] + ms["fp8 weight grad"]
    casts = sum(v for k, v in ms.items() if k.startswith("cast"))
    # torchao's recipe as it runs; then two variants a trainer could build from the same pieces
    fp8 = gemms + casts
    bf16_wgrad = fp8 - ms["fp8 weight grad"] - ms["cast grad+x per group"] + ms["bf16 weight grad"]
    w_once = fp8 - ms["cast w"] - ms["cast w transposed"]
    return {
        "bf16_ms": round(bf16, 3),
        "fp8_gemms_ms": round(gemms, 3),
        "fp8_casts_ms": round(casts, 3),
        "torchao_speedup": round(bf16 / fp8, 3),
        "bf16_weight_grad_speedup": round(bf16 / bf16_wgrad, 3),
        "weights_cast_once_speedup": round(bf16 / w_once, 3),
        "gemms_only_speedup": round(bf16 / gemms, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", choices=sorted(WIDTHS), default="v3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    experts, dim, hidden, top_k = WIDTHS[a.width]["experts"]
    m = -(-a.tokens * top_k // experts // 16) * 16 * experts
    result = {**runs.header(), "width": a.width, "tokens": a.tokens, "rows_routed": m, "products": []}
    for name, k, n in (("gate+up", hidden, 2 * dim), ("down", dim, hidden)):
        ms = pieces(m, experts, k, n)
        row = {"product": name, "k": k, "n": n, "ms": ms, **summary(ms)}
        result["products"].append(row)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\n{name} ({m} x {k} -> {n}, {experts} experts)")
        for piece, v in ms.items():
            print(f"  {piece:24s} {v:8.3f} ms")
        print("  " + ", ".join(f"{k} {v}" for k, v in summary(ms).items()), flush=True)


if __name__ == "__main__":
    main()
