"""MLA attention kernels on one GPU: forward + backward at DeepSeek's head dims, plain and packed rows.

The question: which kernel should each Hopper GPU use, for plain causal rows and for packed chat
rows (several samples per row, each attending only within itself)? Shapes: q/k head dim 192, v head dim
128 (DeepSeek-V2/V3 config.json), 16 heads (V2-Lite), bf16, causal, 64k tokens per call at seq 4k, 8k and
16k; packed rows are filled with whole samples whose lengths follow a chat set's (`--mean-sample`).

Backends (each skipped with its reason where it cannot run here):
- `sdpa_cudnn`: torch SDPA restricted to cuDNN (the catalog's Hopper default today); packed rows take a
  dense block-diagonal boolean mask, as transformers builds from per-sample position ids;
- `flex`: torch's flex_attention, compiled, with a causal or a document-causal BlockMask (no dense mask);
- `fa4`: FlashAttention-4 (`flash_attn.cute`, CuTe DSL, compiled at first call), packed rows through
  `flash_attn_varlen_func` with per-sample cumulative lengths;
- `fa3`: FlashAttention-3 (`flash_attn_interface`), only if an image built it.

The FLOP count is the attention that is real work: causal within each sample (packed rows) or within the
row; so TFLOP/s compare across plain and packed. Prints a table and writes JSON:

    python bench/attention_bench.py --out bench/results/attention/h200-attention-2026-12-02.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HEADS, DQK, DV = 16, 192, 128
TOKENS = 65536


def sample_lengths(seq: int, mean: int, rng: random.Random) -> list[int]:
    """One packed row: whole samples, lengths drawn around `mean`, the last one cut to fill the row."""
    out, left = [], seq
    while left > 0:
        n = max(16, min(left, int(rng.expovariate(1 / mean))))
        out.append(n)
        left -= n
    return out


def causal_flops(lengths: list[int]) -> float:
    """fwd + bwd FLOPs of causal attention within each sample: fwd 2 GEMMs, bwd 2.5x fwd."""
    fwd = sum(2 * HEADS * n * n * (DQK + DV) / 2 for n in lengths)
    return fwd * 3.5


def bench(fn: Callable[[], Any]) -> float:
    import triton.testing as tt

    return tt.do_bench(fn, warmup=10, rep=60, return_mode="median")


def tensors(batch: int, seq: int, layout: str):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, HEADS, seq) if layout == "bhsd" else (batch, seq, HEADS)

    def t(d: int) -> torch.Tensor:
        return torch.randn(*shape, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    q, k, v = t(DQK), t(DQK), t(DV)
    go = torch.randn(*shape, DV, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, go


def step(attn: Callable, q, k, v, go) -> Callable[[], torch.Tensor]:
    def f():
        for t in (q, k, v):
            t.grad = None
        o = attn(q, k, v)
        o.backward(go)
        return o

    return f


def doc_ids(rows: list[list[int]]) -> torch.Tensor:
    ids = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    return torch.stack(ids).cuda()


def reference(q, k, v, rows: list[list[int]] | None) -> torch.Tensor:
    """fp32 math attention, each sample alone: what every kernel must reproduce (bhsd layout)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    outs = []
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        for b in range(q.shape[0]):
            lens = rows[b] if rows else [q.shape[2]]
            start, parts = 0, []
            for n in lens:
                sl = slice(start, start + n)
                parts.append(
                    F.scaled_dot_product_attention(
                        q[b : b + 1, :, sl].float(),
                        k[b : b + 1, :, sl].float(),
                        v[b : b + 1, :, sl].float(),
                        is_causal=True,
                    )
                )
                start += n
            outs.append(torch.cat(parts, dim=2))
    return torch.cat(outs)


def run_cudnn(batch, seq, rows):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, go = tensors(batch, seq, "bhsd")
    mask = None
    if rows:
        d = doc_ids(rows)
        causal = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
        mask = (d[:, None, :, None] == d[:, None, None, :]) & causal

    def attn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return step(attn, q, k, v, go), (q, k, v), lambda o: o


def run_flex(batch, seq, rows):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v, go = tensors(batch, seq, "bhsd")
    if rows:
        d = doc_ids(rows)

        def mask_mod(b, h, qi, ki):
            return (d[b, qi] == d[b, ki]) & (qi >= ki)

        bm = create_block_mask(mask_mod, batch, None, seq, seq, device="cuda")
    else:

        def mask_mod(b, h, qi, ki):
            return qi >= ki

        bm = create_block_mask(mask_mod, None, None, seq, seq, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    return step(lambda q, k, v: compiled(q, k, v, block_mask=bm), q, k, v, go), (q, k, v), lambda o: o


def run_fa4(batch, seq, rows):
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    q, k, v, go = tensors(batch, seq, "bshd")
    if rows:
        lens = [n for r in rows for n in r]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        mx = max(lens)

        def attn(q, k, v):
            t = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
            o = flash_attn_varlen_func(
                t(q),
                t(k),
                t(v),
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=mx,
                max_seqlen_k=mx,
                causal=True,
            )
            o = o[0] if isinstance(o, tuple) else o
            return o.view(batch, seq, HEADS, DV)
    else:

        def attn(q, k, v):
            o = flash_attn_func(q, k, v, causal=True)
            return o[0] if isinstance(o, tuple) else o

    return step(attn, q, k, v, go), (q, k, v), lambda o: o.transpose(1, 2)


def run_fa3(batch, seq, rows):
    import flash_attn_interface as fa3  # noqa: F401  (only images that build it)

    raise RuntimeError("FA3 is importable: add its call here")


BACKENDS = {"sdpa_cudnn": run_cudnn, "flex": run_flex, "fa4": run_fa4, "fa3": run_fa3}


def measure(name: str, seq: int, packed: bool, mean_sample: int) -> dict[str, Any]:
    batch = TOKENS // seq
    rng = random.Random(seq)
    rows = [sample_lengths(seq, mean_sample, rng) for _ in range(batch)] if packed else None
    flops = causal_flops([n for r in rows for n in r] if rows else [seq] * batch)
    rec: dict[str, Any] = {"backend": name, "seq": seq, "batch": batch, "packed": packed}
    if rows:
        rec["samples"] = sum(len(r) for r in rows)
    try:
        f, (q, k, v), to_bhsd = BACKENDS[name](batch, seq, rows)
        t0 = time.perf_counter()
        out = f()
        torch.cuda.synchronize()
        rec["first_call_s"] = round(time.perf_counter() - t0, 2)
        qq, kk, vv = (to_bhsd(x.detach()) for x in (q, k, v))
        n = min(batch, 2)  # the reference in fp32 on two rows bounds its memory at seq 16k
        ref = reference(qq[:n], kk[:n], vv[:n], rows[:n] if rows else None)
        got = to_bhsd(out.detach())[:n].float()
        rec["rel_err"] = float((got - ref).norm() / ref.norm())
        ms = bench(f)
        rec["ms"] = round(ms, 3)
        rec["tflops"] = round(flops / ms / 1e9, 1)
        del f, q, k, v, out
    except Exception as e:  # a kernel that refuses a shape is a result, not a crash
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    torch.cuda.empty_cache()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--seqs", default="4096,8192,16384", help="row lengths, comma-separated")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"any of {', '.join(BACKENDS)}")
    ap.add_argument("--mean-sample", type=int, default=437, help="mean sample length of packed rows")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    names = a.backends.split(",")
    bad = [n for n in names if n not in BACKENDS]
    if bad:
        print(f"--backends: unknown {', '.join(bad)}; allowed: {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    results = []
    print(
        f"{'backend':11s} {'seq':>6s} {'rows':>7s} {'ms':>8s} {'TFLOP/s':>8s} {'rel err':>8s} {'1st s':>6s}"
    )
    for seq in (int(s) for s in a.seqs.split(",")):
        for packed in (False, True):
            for name in names:
                r = measure(name, seq, packed, a.mean_sample)
                results.append(r)
                kind = "packed" if packed else "plain"
                if "error" in r:
                    print(f"{name:11s} {seq:6d} {kind:>7s}  {r['error']}", flush=True)
                else:
                    print(
                        f"{name:11s} {seq:6d} {kind:>7s} {r['ms']:8.2f} {r['tflops']:8.1f} {r['rel_err']:8.1e}"
                        f" {r['first_call_s']:6.1f}",
                        flush=True,
                    )
    meta = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "shape": {
            "heads": HEADS,
            "dqk": DQK,
            "dv": DV,
            "tokens_per_call": TOKENS,
            "mean_sample": a.mean_sample,
        },
    }
    from importlib.metadata import PackageNotFoundError, version

    try:
        meta["flash_attn_4"] = version("flash-attn-4")
    except PackageNotFoundError:
        pass
    Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
