"""Routed-expert LoRA: the weight delta dskit uses (W + s B A, dskit/train/lora/routed.py) against the
unmerged low-rank path (x W^T + s (x A^T) B^T), forward + backward of one MoE layer's local experts.

    python -m bench.routed_lora_delta [--experts 8 --hidden 2048 --inter 1408 --r 16 --tokens 4096]

Defaults: DeepSeek-V2-Lite's expert shape (h 2048, I 1408), 8 local experts (64 at EP 8), 4096 routed
token-slots spread evenly, bf16, AutoEP's CPU for-loop path. Prints seconds per pass (median of 5) for
the frozen base alone and with each form of adapter,
the peak extra bytes each path keeps for backward, and checks that both give the same gradients.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _layer(w1, w2, w3, x, counts):
    """AutoEP's reference for-loop (deepspeed/moe/ep_experts.py `_run_experts_for_loop`), swiglu."""
    outs = []
    for e, xe in enumerate(torch.split(x, counts)):
        outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
    return torch.cat(outs)


def frozen(ws, ads, x, counts, s):
    """The base alone (what a LoRA run without routed adapters computes): input gradients only."""
    return _layer(*ws, x, counts)


def delta(ws, ads, x, counts, s):
    eff = [w + s * torch.bmm(b, a) for w, (a, b) in zip(ws, ads, strict=True)]
    return _layer(*eff, x, counts)


def unmerged(ws, ads, x, counts, s):
    (w1, w2, w3), ((a1, b1), (a2, b2), (a3, b3)) = ws, ads
    outs = []
    for e, xe in enumerate(torch.split(x, counts)):
        g = xe @ w1[e].T + s * (xe @ a1[e].T) @ b1[e].T
        u = xe @ w3[e].T + s * (xe @ a3[e].T) @ b3[e].T
        h = F.silu(g) * u
        outs.append(h @ w2[e].T + s * (h @ a2[e].T) @ b2[e].T)
    return torch.cat(outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    torch.manual_seed(0)
    E, h, inter, r, dt = a.experts, a.hidden, a.inter, a.r, torch.bfloat16
    ws = [torch.randn(E, o, i, dtype=dt) * 0.02 for o, i in ((inter, h), (h, inter), (inter, h))]
    ads = [
        (
            (torch.randn(E, r, i, dtype=dt) * 0.02).requires_grad_(),
            (torch.randn(E, o, r, dtype=dt) * 0.02).requires_grad_(),
        )
        for o, i in ((inter, h), (h, inter), (inter, h))
    ]
    x = torch.randn(a.tokens, h, dtype=dt, requires_grad=True)
    counts = [a.tokens // E] * E
    s = 2.0
    grads = {}
    for name, fn in (("frozen", frozen), ("delta", delta), ("unmerged", unmerged)):
        times = []
        for _ in range(5):
            for p in [q for pair in ads for q in pair] + [x]:
                p.grad = None
            t0 = time.perf_counter()
            fn(ws, ads, x, counts, s).float().square().mean().backward()
            times.append(time.perf_counter() - t0)
        if name != "frozen":
            grads[name] = [q.grad.float().clone() for pair in ads for q in pair]
        print(f"{name:9s} {statistics.median(times):.3f} s per forward+backward")
    rel = max(
        ((g - u).norm() / u.norm()).item() for g, u in zip(grads["delta"], grads["unmerged"], strict=True)
    )
    print(f"adapter gradients agree to {rel:.2e} (relative, bf16)")
    flops_delta = 2 * 3 * a.tokens * h * inter + 6 * 3 * E * r * h * inter  # weight-grad GEMMs + forming B A
    flops_unmerged = 6 * 3 * a.tokens * r * (h + inter)
    held = 2 * 3 * E * h * inter  # bf16 W_eff of the three projections, saved for backward
    print(
        f"adapter FLOPs per pass beyond the frozen layer: delta {flops_delta / 1e9:.1f} G, unmerged "
        f"{flops_unmerged / 1e9:.2f} G; delta keeps {held / 2**20:.0f} MiB of W_eff for backward, "
        f"unmerged {2 * 3 * a.tokens * r / 2**20:.1f} MiB of x A^T"
    )


if __name__ == "__main__":
    main()
