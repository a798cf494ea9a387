"""Where a step's GPU time goes: torch.profiler over a few steps, kernel time summed by category.

`training.profile_steps: N` profiles N steps on rank 0 after a warm-up and writes
OUTPUT_DIR/profile.json (milliseconds per step by category, largest kernels) and a Chrome trace
(OUTPUT_DIR/profile-trace.json, for chrome://tracing or Perfetto). Speed work chooses its levers
from this table (bench/README.md), not from guesses.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

log = logging.getLogger("dskit.train")
WARMUP_STEPS = 5  # the first steps JIT-compile kernels and grow the allocator: not representative

# Ordered: the first pattern that matches a kernel's name decides its category.
CATEGORIES: list[tuple[str, re.Pattern]] = [
    (
        "communication (NCCL/gloo)",
        re.compile(r"nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|alltoall", re.I),
    ),
    ("attention", re.compile(r"sdpa|fmha|flash|attention|mha_", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("loss (softmax, logsumexp)", re.compile(r"logsumexp|log_softmax|softmax|nll_loss|cross_entropy", re.I)),
    (
        "GEMM",
        re.compile(r"gemm|cutlass|xmma|nvjet|wgmma|matmul|cublas|grouped_mm|\bmm\b|addmm|bmm|linear", re.I),
    ),
    (
        "MoE routing (sort, scatter, gather)",
        re.compile(r"sort|scatter|gather|index|histc|bincount|cumsum|permut|topk|nonzero|unique", re.I),
    ),
    ("copies and casts", re.compile(r"copy|memcpy|memset|cat|convert|to_dtype|fill", re.I)),
]
OTHER = "elementwise and other"


def category(kernel: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel):
            return name
    return OTHER


def breakdown(events, steps: int, *, on_gpu: bool) -> dict:
    """Per-step milliseconds by category, plus the 15 largest kernels, from key_averages(): device
    (kernel) time on a GPU, operator self time on the CPU."""
    per_cat: dict[str, float] = {}
    kernels: list[tuple[float, str]] = []
    from torch.autograd import DeviceType

    for e in events:
        # On a GPU only the kernels themselves (device events): an operator's own entry also carries
        # the device time of the kernels it launched, which would count them twice.
        if on_gpu and e.device_type != DeviceType.CUDA:
            continue
        us = (e.self_device_time_total if on_gpu else e.self_cpu_time_total) or 0
        if us <= 0:
            continue
        per_cat[category(e.key)] = per_cat.get(category(e.key), 0.0) + us
        kernels.append((us, e.key))
    total = sum(per_cat.values()) or 1.0
    return {
        "steps": steps,
        "ms_per_step": round(total / 1000 / steps, 3),
        "categories": {
            k: {"ms_per_step": round(v / 1000 / steps, 3), "share": round(v / total, 4)}
            for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [
            {"ms_per_step": round(us / 1000 / steps, 3), "kernel": k[:160]}
            for us, k in sorted(kernels, reverse=True)[:15]
        ],
    }


class StepProfiler:
    """Profiles steps (start, start + n] on rank 0; `after_step(done)` is called after every step."""

    def __init__(self, n_steps: int, total_steps: int, out_dir: str, rank: int, device: torch.device):
        self.n = n_steps if rank == 0 else 0
        self.start = max(0, min(WARMUP_STEPS, total_steps - n_steps))
        self.out, self.device, self.prof = Path(out_dir), device, None

    def after_step(self, done: int) -> None:
        if not self.n:
            return
        if done == self.start and self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        elif self.prof is not None and done == self.start + self.n:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.prof.__exit__(None, None, None)
            table = breakdown(self.prof.key_averages(), self.n, on_gpu=self.device.type == "cuda")
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "profile.json").write_text(json.dumps(table, indent=1) + "\n")
            self.prof.export_chrome_trace(str(self.out / "profile-trace.json"))
            log.info(
                "profile of steps %d-%d: %.1f ms/step; %s",
                self.start + 1,
                done,
                table["ms_per_step"],
                ", ".join(f"{k} {v['ms_per_step']:.1f}" for k, v in table["categories"].items()),
            )
            self.prof, self.n = None, 0
