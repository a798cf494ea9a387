"""GPU benchmark of FP8 against bf16 for the products dskit's FP8 training converts (dskit/train/fp8/compute.py):
each of DeepSeek-V2-Lite's dense linears and its routed experts' grouped GEMMs, forward + backward, as one
training step runs them. Prints a table and writes JSON: the measured time of each, FP8's speed-up, and the
effective TFLOP/s: the measurements dskit/plan/fp8_training.py's rule and speed-ups were set from.

    python bench/fp8_gemm_bench.py --width v3 --out $OUT/h100-fp8-gemm-v3-DATE.json [--tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import runs  # noqa: E402

# The two widths (dskit/catalog/models.yaml): DeepSeek-V2-Lite (hidden 2048, 16 heads of 192 (q) / 128 (v),
# kv rank 512, 64 routed experts of 1408, top-6, 2 shared, a dense layer of 10944) and DeepSeek-V3 (hidden
# 7168, 128 heads, q rank 1536, kv rank 512, 256 routed experts of 2048, top-8, 1 shared, dense 18432; the
# experts of one rank at EP 8: 32)
WIDTHS = {
    "v2-lite": {
        "linears": {  # name: (in, out)
            "q_proj": (2048, 16 * 192),
            "kv_a_proj_with_mqa": (2048, 512 + 64),
            "kv_b_proj": (512, 16 * (128 + 128)),
            "o_proj": (16 * 128, 2048),
            "shared_experts.gate_proj": (2048, 2 * 1408),
            "shared_experts.down_proj": (2 * 1408, 2048),
            "dense mlp.gate_proj": (2048, 10944),
            "dense mlp.down_proj": (10944, 2048),
        },
        "experts": (64, 1408, 2048, 6),  # experts on the rank, their width, hidden, top-k
    },
    "v3": {
        "linears": {
            "q_a_proj": (7168, 1536),
            "q_b_proj": (1536, 128 * 192),
            "kv_a_proj_with_mqa": (7168, 512 + 64),
            "kv_b_proj": (512, 128 * (128 + 128)),
            "o_proj": (128 * 128, 7168),
            "shared_experts.gate_proj": (7168, 2048),
            "shared_experts.down_proj": (2048, 7168),
            "dense mlp.gate_proj": (7168, 18432),
            "dense mlp.down_proj": (18432, 7168),
        },
        "experts": (32, 2048, 7168, 8),  # EP 8: 32 of the 256 on a rank, top-8 of 256 -> 1 of 8 per rank
    },
}


def linear_rows(linears: dict, tokens: int, compiled: bool) -> list[dict]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    rows = []
    for name, (k, n) in linears.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        flops = 3 * 2 * tokens * k * n  # forward, input grad, weight grad
        row = {"kind": "linear", "name": name, "in": k, "out": n, "tokens": tokens, "compiled": compiled}
        for recipe in ("bf16", "rowwise", "tensorwise"):
            lin = nn.Sequential(nn.Linear(k, n, bias=False)).to("cuda", torch.bfloat16)
            if recipe != "bf16":
                convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name(recipe))
            torch._dynamo.reset()  # each module its own compile, not recompiles of one capped at 8
            f = torch.compile(lin) if compiled else lin

            def step(f=f, x=x, grad=grad):
                f(x).backward(grad)

            s = runs.cuda_median_s(step)
            row[f"{recipe}_ms"] = round(s * 1e3, 4)
            row[f"{recipe}_tflops"] = round(flops / s / 1e12, 1)
        for recipe in ("rowwise", "tensorwise"):
            row[f"{recipe}_speedup"] = round(row["bf16_ms"] / row[f"{recipe}_ms"], 3)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def expert_rows(width: tuple[int, int, int, int], tokens: int) -> list[dict]:
    """The routed experts' three grouped GEMMs of one MoE layer on one rank, tokens x top-k rows (as many
    arrive at each rank as leave it) spread evenly over the rank's experts in groups of 16-row multiples
    (as AutoEP pads them for FP8)."""
    EXPERTS, EXPERT_DIM, HIDDEN, TOP_K = width
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as fp8_mm

    rows_per = -(-tokens * TOP_K // EXPERTS // 16) * 16
    m = rows_per * EXPERTS
    offs = torch.arange(rows_per, m + 1, rows_per, device="cuda", dtype=torch.int32)
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w13 = [torch.randn(EXPERTS, EXPERT_DIM, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(2)]  # fmt: skip
    w2 = torch.randn(EXPERTS, HIDDEN, EXPERT_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 3 * 3 * 2 * m * HIDDEN * EXPERT_DIM  # three products, each forward + two backward

    def layer(mm):
        gate, up = (mm(x, w.transpose(-2, -1)) for w in w13)
        out = mm(torch.nn.functional.silu(gate) * up, w2.transpose(-2, -1))
        out.backward(torch.ones_like(out))

    row = {"kind": "experts", "name": "routed experts (gate, up, down)", "rows": m, "tokens": tokens}
    for name, mm in (
        ("bf16", lambda a, b: torch._grouped_mm(a, b, offs=offs)),
        ("rowwise", lambda a, b: fp8_mm(a, b, offs, pad_token_groups_for_grouped_mm=False)),
    ):
        s = runs.cuda_median_s(lambda mm=mm: layer(mm))
        row[f"{name}_ms"] = round(s * 1e3, 4)
        row[f"{name}_tflops"] = round(flops / s / 1e12, 1)
    row["rowwise_speedup"] = round(row["bf16_ms"] / row["rowwise_ms"], 3)
    print(_line(row), flush=True)
    return [row]


def _line(r: dict) -> str:
    speed = " ".join(f"{k.split('_')[0]} {r[k]:.2f}x" for k in r if k.endswith("_speedup"))
    tf = " ".join(f"{k.split('_')[0]} {r[k]:.0f}" for k in r if k.endswith("_tflops"))
    return f"{r['name']:34s} {'compiled' if r.get('compiled') else 'eager':8s} TFLOP/s {tf:40s} {speed}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per micro-step (default 8192: 2 x 4096)")
    ap.add_argument("--width", choices=sorted(WIDTHS), default="v2-lite", help="the model's widths")
    a = ap.parse_args()
    w = WIDTHS[a.width]
    result = {**runs.header(), "width": a.width, "tokens": a.tokens, "rows": []}
    result["rows"] += expert_rows(w["experts"], a.tokens)
    for compiled in (False, True):
        result["rows"] += linear_rows(w["linears"], a.tokens, compiled)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['hardware']} | {result['date']} | {result['versions']}")


if __name__ == "__main__":
    main()
