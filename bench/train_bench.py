"""GPU benchmark of the dskit trainer: tokens/s/GPU, MFU and peak memory, one table + one JSON file.

Trains a few-layer DeepSeek-V2-Lite shape through the real path (plan -> run.yaml -> `dskit train
--local` -> python -m dskit.train) and, when given the reference baseline script, runs it beside
ours in the same session (figures move ~7% between machines, so only same-call numbers compare).

    python bench/train_bench.py --out bench/results/RESULT.json [--baseline PATH/baseline_probe.py]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import runs  # noqa: E402

# name -> (extra spec overrides, DeepSpeed config sections patched into run.yaml). Shape of the reference
# baseline: 4 layers, seq 4096, micro-batch 2. AutoEP knobs are measured here before any becomes a
# plan default (dskit/plan/deepspeed.py); see deepspeed/module_inject/auto_ep_config.py.
VARIANTS: dict[str, tuple[list[str], dict]] = {
    "dskit, full-logits loss (previous default)": (["overrides.loss=full"], {}),
    "dskit, plan default (chunked fused loss)": ([], {}),
    "dskit, full-logits loss (repeat: run-to-run spread)": (["overrides.loss=full"], {}),
    "dskit, plan default (repeat: run-to-run spread)": ([], {}),
}
# Measured and lost on one H200 (results/h200-levers-2026-11-30.json), so not run by default:
LOSERS: dict[str, tuple[list[str], dict]] = {
    "dskit + AutoEP gate_up_impl=fused": ([], {"expert_parallel": {"gate_up_impl": "fused"}}),
    "dskit + AutoEP combine_impl=fused_weighted_sum": (
        [],
        {"expert_parallel": {"combine_impl": "fused_weighted_sum"}},
    ),
    "dskit + both AutoEP knobs": (
        [],
        {"expert_parallel": {"gate_up_impl": "fused", "combine_impl": "fused_weighted_sum"}},
    ),
    "dskit, activation ckpt every layer": (["overrides.activation_checkpointing=1"], {}),
}
# Levers not yet measured (--probes): ZeRO-2 keeps whole 16-bit weights on every rank (no per-module
# gathers, no hooks), which one GPU can always afford; the host-bound small micro-steps are the target.
# Measured eager, before regional compile became the GPU default: pinned off to reproduce that table.
EAGER = ["overrides.compile=off"]
PROBES: dict[str, tuple[list[str], dict]] = {
    "dskit, plan default (ZeRO-3)": (EAGER, {}),
    "dskit + ZeRO-2": (EAGER, {"zero_optimization": {"stage": 2}}),
    # the plan's own choice for global batch 16 (micro-batch 16, no checkpointing): the 40% MFU goal
    "dskit, gb16 plan choice (ZeRO-3)": ([*EAGER, "training.global_batch=16"], {}),
    "dskit + ZeRO-2, gb16 plan choice": (
        [*EAGER, "training.global_batch=16"],
        {"zero_optimization": {"stage": 2}},
    ),
}
# Measured: checkpointing every 2nd layer ran 5x slower than every layer (3.3 vs 0.99 s/step at 135.6 of
# ~140 GiB reserved, with the full-logits loss). Is it the allocator near capacity? (--checkpointing)
GB16 = ["training.global_batch=16"]
GB16_EAGER = [*EAGER, *GB16]  # CHECKPOINTING's table was measured eager
CHECKPOINTING: dict[str, tuple[list[str], dict]] = {
    "gb16, ckpt every 2nd layer": ([*GB16_EAGER, "overrides.activation_checkpointing=2"], {}),
    "gb16, ckpt every layer": ([*GB16_EAGER, "overrides.activation_checkpointing=1"], {}),
    "gb16, full-logits loss, ckpt every 2nd layer": (
        [*GB16_EAGER, "overrides.loss=full", "overrides.activation_checkpointing=2"],
        {},
    ),
    "gb16, full-logits loss, ckpt every layer": (
        [*GB16_EAGER, "overrides.loss=full", "overrides.activation_checkpointing=1"],
        {},
    ),
}
# Regional torch.compile (RMSNorm, SwiGLU, rotary; dskit/train/compile.py), --compile. First measured
# (results/training/h200-compile-*-2026-11-30.json) with the same functions patched in by a sitecustomize at
# commit cf716ce, before they became trainer code. Each side is forced: on GPUs the default is on.
COMPILE: dict[str, tuple[list[str], dict]] = {
    "mb2 (reference shape), eager": (["overrides.compile=off"], {}),
    "mb2 (reference shape), regional compile": (["overrides.compile=on"], {}),
    "gb16 plan choice, eager": ([*GB16, "overrides.compile=off"], {}),
    "gb16 plan choice, regional compile": ([*GB16, "overrides.compile=on"], {}),
}
# The numerics goal (--numerics): 50 steps of the default (regional compile, chunked loss) against
# the plain path (eager, full logits), same seed and data, each twice: the two runs of one path are the
# GPU's run-to-run noise (non-deterministic kernels), the yardstick for the difference between paths.
S50 = ["training.steps=50"]
PLAIN = [*S50, "overrides.compile=off", "overrides.loss=full", "overrides.optimizer_step=deepspeed"]
NUMERICS: dict[str, tuple[list[str], dict]] = {
    "50 steps, default (compile, chunked loss)": (S50, {}),
    "50 steps, plain (eager, full logits)": (PLAIN, {}),
    "50 steps, default, repeat": (S50, {}),
    "50 steps, plain, repeat": (PLAIN, {}),
    # FlashAttention-4 is the Hopper default: the plain path with the attention before it
    "50 steps, plain with cuDNN attention (eager, full logits, sdpa_cudnn)": (
        [*PLAIN, "overrides.attention=sdpa_cudnn"],
        {},
    ),
    # each ZeRO stage the planner may pick, against ZeRO-3 (the same first weights since the
    # seeded init; 1 GPU: stage 1 and 2 differ only in when gradients are reduced)
    "50 steps, ZeRO-3 pinned": ([*S50, "overrides.zero_stage=3"], {}),
    "50 steps, ZeRO-2 pinned": ([*S50, "overrides.zero_stage=2"], {}),
    "50 steps, ZeRO-1 pinned": ([*S50, "overrides.zero_stage=1"], {}),
}
# The scaling goal at this shape (--scaling, with --gpus 2): tokens/s/GPU at EP 2 against one
# GPU. AutoEP's async_split_plan copies the all-to-all split sizes to the host on a side stream while
# the permute kernels run, instead of blocking the host before them.
SCALING: dict[str, tuple[list[str], dict]] = {
    "plan default": ([], {}),
    "+ AutoEP async_split_plan": ([], {"expert_parallel": {"async_split_plan": True}}),
    "plan default (repeat: run-to-run spread)": ([], {}),
    "profile: plan default": (["training.profile_steps=3"], {}),
}
# --small-batch: the reference shape's step, host- and parameter-bound. The fused optimizer
# step (dskit/train/fused_step.py: the gradient norm without DeepSpeed's fp64 copies, the clip inside
# torch's fused AdamW) and compiling each whole attention block (ZeRO-1/2) won their first measurements
# (results/training/h200-small-batch-2026-12-01.json and -fused-, run as environment probes at the time) and are
# plan defaults; here each is taken away again, at micro-batch 2 and 16. Values: (spec sets, patch).
DS_STEP = ["overrides.optimizer_step=deepspeed"]
NO_ATTN = {"parallel": {"compile_attention": False}}
SMALL_BATCH: dict[str, tuple[list[str], dict]] = {
    "mb2, plan default (fused step, attention compiled)": ([], {}),
    "mb2, no attention compile": ([], NO_ATTN),
    "mb2, DeepSpeed's step, no attention compile": (DS_STEP, NO_ATTN),
    "gb16, plan default": (GB16, {}),
    "gb16, no attention compile": (GB16, NO_ATTN),
    "gb16, DeepSpeed's step, no attention compile": ([*GB16, *DS_STEP], NO_ATTN),
}
# --attention: FlashAttention-4, the Hopper default since 2026-12-02, against cuDNN SDPA on
# plain text at the host-bound reference shape and at the plan's pick for global batch 16 (FA4's call is
# opaque to torch.compile: the compiled attention block breaks its graph around it).
CUDNN = ["overrides.attention=sdpa_cudnn"]
ATTENTION: dict[str, tuple[list[str], dict]] = {
    "mb2, plan default (FlashAttention-4)": ([], {}),
    "mb2, cuDNN SDPA": (CUDNN, {}),
    "gb16, plan default (FlashAttention-4)": (GB16, {}),
    "gb16, cuDNN SDPA": ([*GB16, *CUDNN], {}),
}
# The defaults beside the reference baseline in one call (--side-by-side, with --baseline): the
# reference shape and the plan's own choice for global batch 16 (its 40% MFU goal).
SIDE_BY_SIDE: dict[str, tuple[list[str], dict]] = {
    "dskit, plan default (reference shape)": ([], {}),
    "dskit, gb16 plan choice": (GB16, {}),
}
# --host-sync: the host-bound shapes (layers, seq, global batch on one GPU) with DeepSpeed's
# ThroughputTimer back on as it was before (a device synchronisation at each micro-step's start and end),
# beside the plan default without it.
TIMER_ON = {"timers": {"throughput": {"enabled": True, "synchronized": True}}}
HOST_SYNC: dict[str, tuple[list[str], dict]] = {
    f"L{layers} s{seq} gb{gb}, {side}": (
        [f"model.num_layers={layers}", f"training.seq_len={seq}", f"training.global_batch={gb}"],
        patch,
    )
    for layers, seq, gb in ((6, 1024, 2), (3, 4096, 1), (8, 2048, 1), (4, 2048, 2))
    for side, patch in (("plan default", {}), ("ThroughputTimer synchronised (before)", TIMER_ON))
}
#: AutoEP's fused top-k combine, which the plan turns on from 32,768 tokens a micro-step (dskit/plan/memory.py
#: `fused_combine`), against its eager weighted sum at that size (dskit/plan/speed.py says why the plan
#: credits it no time). Seq 4096, micro-batch 8, one micro-step a step
EAGER_COMBINE = {"expert_parallel": {"combine_impl": "weighted_sum"}}
COMBINE: dict[str, tuple[list[str], dict]] = {
    f"32768 tokens, {side}": (["training.global_batch=8", "overrides.micro_batch=8"], patch)
    for side, patch in (("plan default (fused combine)", {}), ("eager weighted sum", EAGER_COMBINE))
}
S300 = ["training.steps=300", "training.log_every=1"]
FP8_SHAPES = {"mb2": [], "gb16": GB16}
FP8: dict[str, tuple[list[str], dict]] = {  # speed: bf16 and each recipe in one call, per shape
    f"{shape}, {recipe}": ([*sets, f"training.fp8={recipe}"], {})
    for shape, sets in FP8_SHAPES.items()
    for recipe in ("off", "rowwise", "tensorwise")
}
FP8_CURVES: dict[str, tuple[list[str], dict]] = {  # numerics: 300 steps, bf16 twice for its own spread
    f"300 steps, {recipe}{suffix}": ([*S300, f"training.fp8={recipe}"], {})
    for recipe, suffix in (("off", ""), ("off", " (repeat)"), ("rowwise", ""), ("tensorwise", ""))
}
PROFILED = {  # profiled separately: the profiler slows the steps it watches
    "profile: full-logits loss": (["overrides.loss=full", "training.profile_steps=3"], {}),
    "profile: plan default": (["training.profile_steps=3"], {}),
    "profile: gb16 plan choice": ([*GB16, "training.profile_steps=3"], {}),
}
BASE = [
    "model.num_layers=4",
    "training.seq_len=4096",
    "training.steps=20",
    "training.log_every=1",
    "checkpoint.every=1000",
    "checkpoint.final=false",
]
WARMUP_STEPS = 3
#: the catalog profile of the GPU the rows run on (--gpu)
GPU = "h200-141gb"
MODEL = "deepseek-v2-lite"
#: a model slice of bench/plan_bench.py (--slice) trained in place of MODEL, or None
SLICE: str | None = None


def spec_for(name: str, sets: list[str], work: Path, gpus: int):
    """The spec of a bench row: V2-Lite on `gpus` H200s of one node, the baseline's sets, then `sets`."""
    from dskit.spec import load_spec

    flags = {
        "hardware.gpu": GPU,
        "hardware.gpus_per_node": gpus,
        "runtime.kind": "none",
        "storage.root": str(work / "storage"),
        "name": re.sub(r"[^a-z0-9]+", "-", name.lower())[:40].strip("-"),
    }
    base = BASE
    if SLICE:  # a slice's config.json (bench/plan_bench.py SLICES) at its own depth, in place of the preset
        from bench import plan_bench

        base = [x for x in BASE if not x.startswith("model.num_layers=")]
        base += plan_bench._resolve([f"model.path={{slice:{SLICE}}}"])
    else:
        flags["model.preset"] = MODEL
    # micro-batch 2 per GPU, as the baseline; EP = GPUs (the planner's choice inside one node)
    return load_spec(sets=[*base, f"training.global_batch={2 * gpus}", *sets], flags=flags)


def run_dskit(
    name: str, sets: list[str], ds_patch: dict, work: Path, gpus: int, env: dict | None = None
) -> dict:
    from dskit.plan.schema import load_plan
    from dskit.render.run_dir import render_run

    spec = spec_for(name, sets, work, gpus)
    run = render_run(spec, "slurm", work / spec.name)
    plan, run_dir = run.plan, run.out
    if ds_patch:  # a lever under measurement, not yet a plan decision (key "parallel": the plan's own)
        run_yaml = run_dir / "run.yaml"
        data = yaml.safe_load(run_yaml.read_text())
        for section, values in ds_patch.items():
            (data["parallel"] if section == "parallel" else data["deepspeed"][section]).update(values)
        run_yaml.write_text(yaml.safe_dump(data, sort_keys=False))
    cmd = [sys.executable, "-m", "dskit", "train", "--local", str(run_dir)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})})
    wall_s = round(time.monotonic() - t0, 1)
    log = proc.stdout + proc.stderr
    (work.parent / f"{spec.name}.log").write_text(log)
    if proc.returncode != 0:
        return {"variant": name, "error": log[-3000:]}
    otherwise = runs.ran_otherwise(run_dir)
    if otherwise:  # a fallback is not a measurement of the plan: no row
        return {"variant": name, "error": f"{otherwise}; not recorded", "plan": plan.summary()}
    recs = runs.step_records(run_dir)
    m = runs.steady(recs, WARMUP_STEPS)
    attention = re.search(r"attention: (\S+)", log)
    out = {
        "variant": name,
        "step_s": m["step_s"],
        "tok_s_gpu": m["tokens_per_s_per_gpu"],
        "mfu": m["mfu"],
        "peak_alloc_gb": m["peak_alloc_gib"],
        "peak_reserved_gb": m["peak_reserved_gib"],
        "alloc_retries": sum(r.get("alloc_retries", 0) for r in recs),
        "first_step_s": recs[0]["step_time_s"],  # includes torch.compile's first compilation
        "wall_s": wall_s,  # launch to exit
        "loss_first": m["loss_first"],
        "loss_last": m["loss_last"],
        # real (non-pad) tokens, what chat runs compare (tok_s_gpu counts whole rows)
        "real_tok_s_gpu": m["real_tokens_per_s_per_gpu"],
        "packing_efficiency": m["packing_efficiency"],
        "attention": attention.group(1) if attention else None,
        "plan": plan.summary(),
        "overrides": sets,
        "deepspeed_patch": ds_patch,
        "losses": [r["loss"] for r in recs],
        "fp8": runs.ran_record(run_dir).get("fp8"),  # which modules computed in FP8, with which kernels
    }
    profile = Path(load_plan(run_dir / "run.yaml").run.output_dir) / "profile.json"
    if profile.is_file():
        from dskit.train.profile import gpu_busy, host_table

        out["profile"] = json.loads(profile.read_text())
        trace = json.loads((profile.parent / "profile-trace.json").read_text())
        out["gpu_busy"] = gpu_busy(trace)
        out["host"] = host_table(trace, out["profile"]["steps"])
    return out


def run_baseline(script: Path, variant: str, sdpa: str, gpus: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        str(script),
        "--variant",
        variant,
        "--sdpa",
        sdpa,
    ]
    if variant.startswith("autoep"):
        cmd += ["--ep", str(gpus)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    if not m:
        return {"variant": f"baseline {variant}/{sdpa}", "error": (proc.stdout + proc.stderr)[-3000:]}
    r = json.loads(m.group(1))
    return {
        "variant": f"baseline {variant} (sdpa {sdpa})",
        "step_s": r["step_s"],
        "tok_s_gpu": r["tok_s_gpu"],
        "mfu": r["mfu"],
        "peak_alloc_gb": r["peak_alloc_gb"],
        "peak_reserved_gb": r["peak_reserved_gb"],
        "loss_last": r["loss"],
    }


def main() -> None:
    global GPU, MODEL, SLICE  # --gpu, --model and --slice set what spec_for uses
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write (rewritten after every variant)")
    ap.add_argument("--baseline", type=Path, help="reference baseline_probe.py to run beside dskit")
    ap.add_argument("--work", type=Path, help="keep run dirs and logs here (default: a temporary dir)")
    ap.add_argument("--gpu", default=GPU, help=f"the GPU's catalog profile (default {GPU})")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of this machine to use (EP = this)")
    ap.add_argument("--only", help="run only variants whose name contains this text")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled runs")
    ap.add_argument("--losers", action="store_true", help="also run the levers that lost before")
    ap.add_argument("--probes", action="store_true", help="run only the unmeasured levers (PROBES)")
    ap.add_argument("--checkpointing", action="store_true", help="run only the CHECKPOINTING variants")
    ap.add_argument("--compile", action="store_true", help="run only the COMPILE variants")
    ap.add_argument("--numerics", action="store_true", help="run only the NUMERICS variants (50-step curves)")
    ap.add_argument("--scaling", action="store_true", help="run only the SCALING variants (use with --gpus)")
    ap.add_argument("--side-by-side", action="store_true", help="run only SIDE_BY_SIDE (and the baseline)")
    ap.add_argument("--small-batch", action="store_true", help="run only SMALL_BATCH (small probes)")
    ap.add_argument("--attention", action="store_true", help="run only ATTENTION (FA4 against cuDNN SDPA)")
    ap.add_argument("--host-sync", action="store_true", help="run only HOST_SYNC (the timer's syncs)")
    ap.add_argument("--fp8", action="store_true", help="run only FP8: bf16 and each FP8 recipe, per shape")
    ap.add_argument(
        "--combine", action="store_true", help="run only COMBINE (fused against eager at 32,768 tokens)"
    )
    ap.add_argument("--fp8-curves", action="store_true", help="run only FP8_CURVES (300-step loss curves)")
    ap.add_argument("--model", default=MODEL, help=f"the model preset (default {MODEL}), cut to --layers")
    ap.add_argument(
        "--slice",
        help="train a model slice of bench/plan_bench.py's SLICES instead (v3-ep8-3l: DeepSeek-V3's width, "
        "3 all-MoE layers with EP 8's 32 experts, one H200), at its own depth",
    )
    ap.add_argument("--layers", type=int, help="decoder layers of every row (default 4)")
    ap.add_argument("--seq-len", type=int, help="sequence length of every row (default 4096)")
    a = ap.parse_args()
    GPU, MODEL, SLICE = a.gpu, a.model, a.slice
    if a.slice:
        from bench import plan_bench

        if a.slice not in plan_bench.SLICES:
            ap.error(f"--slice: {a.slice!r} is none of {', '.join(plan_bench.SLICES)}")
        if a.layers:
            ap.error("--slice trains the slice at its own depth: leave out --layers")
    import torch

    result = {
        **runs.header(),
        "gpus": torch.cuda.device_count(),
        "shape": f"{f'slice {a.slice}' if a.slice else f'{a.model}, {a.layers or 4} layers'}, seq {a.seq_len or 4096}, micro-batch 2 per GPU unless a row sets it, {a.gpus} "
        "GPU(s), EP = GPUs; each row's plan says its ZeRO stage and precision",
        "rows": [],
    }

    def record(row: dict) -> None:
        # written after every variant: a call cut short by its time limit keeps what it measured
        result["rows"].append(row)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print(_row_line(row), flush=True)

    if a.work:
        a.work.mkdir(parents=True, exist_ok=True)
    groups = {
        "probes": PROBES,
        "checkpointing": CHECKPOINTING,
        "compile": COMPILE,
        "numerics": NUMERICS,
        "scaling": SCALING,
        "side_by_side": SIDE_BY_SIDE,
        "small_batch": SMALL_BATCH,
        "attention": ATTENTION,
        "host_sync": HOST_SYNC,
        "fp8": FP8,
        "fp8_curves": FP8_CURVES,
        "combine": COMBINE,
    }
    chosen = [g for g in groups if getattr(a, g)]
    if len(chosen) > 1:
        ap.error(f"one variant group at a time: {', '.join('--' + g.replace('_', '-') for g in chosen)}")
    variants = (
        groups[chosen[0]]
        if chosen
        else {**VARIANTS, **(LOSERS if a.losers else {}), **({} if a.no_profile else PROFILED)}
    )
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        if a.baseline and not a.only:
            if a.gpus == 1:
                record(run_baseline(a.baseline, "z3leaf", "cudnn", a.gpus))
            record(run_baseline(a.baseline, "autoep", "default", a.gpus))
        shape = [f"model.num_layers={a.layers}"] * bool(a.layers) + [f"training.seq_len={a.seq_len}"] * bool(
            a.seq_len
        )
        for name, (sets, ds_patch, *env) in variants.items():
            if a.only and a.only not in name:
                continue
            record(run_dskit(name, [*shape, *sets], ds_patch, Path(tmp), a.gpus, *env))
    if a.fp8 or a.fp8_curves:
        speedup_vs_bf16(result["rows"])
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['hardware']} | {result['date']} | {result['versions']}")
    print(
        f"{'variant':52s} {'step s':>7s} {'tok/s/GPU':>10s} {'MFU':>7s} {'alloc GiB':>10s} {'resv GiB':>9s}"
    )
    for r in result["rows"]:
        print(_row_line(r))
    if a.numerics:
        result["numerics"] = loss_spread(result["rows"])
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        for k, v in result["numerics"].items():
            print(f"{k:60s} max |relative loss difference| {v:.3%}")
    for r in result["rows"]:
        if "profile" in r:
            print(f"\n{r['variant']}: {r['profile']['ms_per_step']} ms/step of GPU kernel time")
            for k, v in r["profile"]["categories"].items():
                print(f"  {k:40s} {v['ms_per_step']:8.2f} ms  {100 * v['share']:5.1f}%")


def speedup_vs_bf16(rows: list[dict]) -> None:
    """Each FP8 row's tokens/s over the bf16 row of its shape (same call, the row named `SHAPE, off`), and
    for the curves, its largest relative loss difference from bf16 beside bf16's own run-to-run spread."""
    by_name = {r["variant"]: r for r in rows if "error" not in r}
    for r in by_name.values():
        shape, _, recipe = r["variant"].rpartition(", ")
        bf16 = by_name.get(f"{shape}, off")
        if recipe in ("rowwise", "tensorwise") and bf16:
            r["speedup_vs_bf16"] = round(r["tok_s_gpu"] / bf16["tok_s_gpu"], 3)
            curve, ref = r["losses"], bf16["losses"]
            r["max_rel_loss_diff_vs_bf16"] = max(
                abs(x - y) / abs(y) for x, y in zip(curve, ref, strict=False)
            )
            repeat = by_name.get(f"{shape}, off (repeat)")
            if repeat:
                r["bf16_run_to_run"] = max(
                    abs(x - y) / abs(y) for x, y in zip(repeat["losses"], ref, strict=False)
                )


def loss_spread(rows: list[dict]) -> dict[str, float]:
    """Largest relative difference between the loss curves of two runs, step by step, for every pair of
    the NUMERICS runs: same path twice (noise) and across paths."""
    curves = {r["variant"]: r["losses"] for r in rows if "losses" in r}
    names = list(curves)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            pairs = list(zip(curves[a], curves[b], strict=False))  # a run cut short compares its steps
            if pairs:
                out[f"{a} | {b}"] = max(abs(x - y) / abs(y) for x, y in pairs)
    return out


def _row_line(r: dict) -> str:
    if "error" in r:
        return f"{r['variant']:52s} ERROR: {r['error'][-400:]}"
    return (
        f"{r['variant']:52s} {r['step_s']:7.3f} {r['tok_s_gpu']:10d} {r['mfu']:7.4f} "
        f"{r['peak_alloc_gb']:10.2f} {r['peak_reserved_gb']:9.2f}"
        + (f"  alloc retries {r['alloc_retries']}" if r.get("alloc_retries") else "")
    )


if __name__ == "__main__":
    main()
