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

from dskit.launch.contract import PROFILE_FILE, PROFILE_TRACE_FILE

log = logging.getLogger("dskit.train")
WARMUP_STEPS = 5  # the first steps JIT-compile kernels and grow the allocator: not representative

# Ordered: the first pattern that matches a kernel's name decides its category.
CATEGORIES: list[tuple[str, re.Pattern]] = [
    # NCCL runs all-to-all as grouped send/recv (ncclDevKernel_SendRecv); under AutoEP that is the MoE
    # dispatch and combine. ZeRO-3 gathers parameters (ZeRO-1/2: the updated weights, once per step) and
    # reduce-scatters gradients. Kernel time of
    # collectives overlaps compute on other streams: a share here is an upper bound on exposed time.
    ("all-to-all (MoE dispatch/combine)", re.compile(r"all_?to_?all|sendrecv", re.I)),
    ("all-gather (ZeRO-3 parameters)", re.compile(r"all_?gather", re.I)),
    ("reduce-scatter, all-reduce (gradients)", re.compile(r"reduce_?scatter|all_?reduce", re.I)),
    ("communication, other (NCCL/gloo)", re.compile(r"nccl|gloo|broadcast|barrier", re.I)),
    ("attention", re.compile(r"sdpa|fmha|flash|attention|mha_", re.I)),
    # the fused step's one pass (dskit/train/adamw_cast.py) is an Inductor kernel named after its ops:
    # Adam's bias corrections (1 - beta^step, a square root) are what give it away
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|triton_\w*pow_rsub_sqrt", re.I)),
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
COMMUNICATION = tuple(name for name, _ in CATEGORIES[:4])


def category(kernel: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel):
            return name
    return OTHER


def breakdown(events, steps: int, *, on_gpu: bool) -> dict:
    """Per-step milliseconds by category, plus the 15 largest kernels, from the profiler's events:
    device kernels on a GPU (each once; operator entries and GPU-timeline annotations such as
    `Optimizer.step#FusedAdam.step` also carry device time and would count it twice), operator self
    time on the CPU."""
    from torch.autograd import DeviceType

    per_kernel: dict[str, float] = {}
    for e in events:
        if on_gpu:
            if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue
            us = e.self_device_time_total
        else:
            us = e.self_cpu_time_total
        if us and us > 0:
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + us
    return kernel_table(per_kernel, steps)


def kernel_table(per_kernel: dict[str, float], steps: int) -> dict:
    """Microseconds per kernel name over `steps` steps -> the table profile.json holds. Also reads
    other trainers' Chrome traces (bench/peer_bench.py --profile), so both sides are cut the same way."""
    per_cat: dict[str, float] = {}
    for name, us in per_kernel.items():
        per_cat[category(name)] = per_cat.get(category(name), 0.0) + us
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
            for k, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
        ],
    }


def gpu_busy(trace: dict) -> dict:
    """How much of a Chrome trace's kernel span the GPU was running anything (kernel intervals merged
    over all streams): below 1, the host or a synchronisation kept it waiting."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    span = (max(b for _, b in spans) - spans[0][0]) if spans else 0.0
    return {
        "span_ms": round(span / 1000, 3),
        "busy_ms": round(busy / 1000, 3),
        "busy": round(busy / span, 4) if span else None,
    }


def trace_kernels(trace: dict) -> dict[str, float]:
    """Microseconds per GPU kernel name in a torch.profiler Chrome trace (kernels, memcpys, memsets)."""
    per_kernel: dict[str, float] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            per_kernel[e["name"]] = per_kernel.get(e["name"], 0.0) + float(e.get("dur", 0))
    return per_kernel


#: CUDA runtime/driver calls that block the host until the GPU catches up
_SYNCS = re.compile(r"Synchronize|cudaMemcpy(?!Async)|EventSynchronize|StreamWaitEvent", re.I)


def host_table(trace: dict, steps: int, top: int = 15) -> dict:
    """The host's side of a Chrome trace, per step: CUDA runtime calls by name (launches, syncs) with
    their count and time, the time the host spent blocked in synchronising calls, and the CPU
    operators with the most time (inclusive of the operators they call). Where the GPU is idle (gpu_busy below 1), this says what the
    host was doing instead."""
    calls: dict[str, list[float]] = {}
    ops: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat, name, dur = e.get("cat"), e.get("name", ""), float(e.get("dur", 0))
        if cat in ("cuda_runtime", "cuda_driver"):
            c = calls.setdefault(name, [0, 0.0])
        elif cat == "cpu_op":
            c = ops.setdefault(name, [0, 0.0])
        else:
            continue
        c[0] += 1
        c[1] += dur

    def per_step(d: dict[str, list[float]], n: int) -> dict[str, dict]:
        best = sorted(d.items(), key=lambda kv: -kv[1][1])[:n]
        return {k: {"calls": round(v[0] / steps, 1), "ms": round(v[1] / steps / 1000, 3)} for k, v in best}

    launches = sum(v[0] for k, v in calls.items() if "Launch" in k)
    blocked = sum(v[1] for k, v in calls.items() if _SYNCS.search(k))
    return {
        "launches_per_step": round(launches / steps, 1),
        "sync_calls_per_step": round(sum(v[0] for k, v in calls.items() if _SYNCS.search(k)) / steps, 1),
        "host_blocked_ms_per_step": round(blocked / steps / 1000, 3),
        "runtime_calls": per_step(calls, top),
        "cpu_ops_inclusive": per_step(ops, top),
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
            table = breakdown(self.prof.events(), self.n, on_gpu=self.device.type == "cuda")
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / PROFILE_FILE).write_text(json.dumps(table, indent=1) + "\n")
            self.prof.export_chrome_trace(str(self.out / PROFILE_TRACE_FILE))
            log.info(
                "profile of steps %d-%d: %.1f ms/step; %s",
                self.start + 1,
                done,
                table["ms_per_step"],
                ", ".join(f"{k} {v['ms_per_step']:.1f}" for k, v in table["categories"].items()),
            )
            self.prof, self.n = None, 0
