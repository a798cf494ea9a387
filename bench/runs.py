"""What the bench scripts read back from a finished run: its per-step records and their steady state."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

#: the committed results and their manifest (bench/README.md "Results")
RESULTS = Path(__file__).resolve().parent / "results"
MANIFEST = RESULTS / "MANIFEST.yaml"


def results(*series: str) -> list[Path]:
    """The committed result files of these series (the manifest's `series` field), in path order."""
    import yaml

    entries = yaml.safe_load(MANIFEST.read_text())["results"]
    return sorted(RESULTS / e["path"] for e in entries if e["series"] in series)


#: the `hardware` of a result computed by dskit's models, not measured
MODELS_ONLY = "none: dskit plan's memory and step-time models only"


def model_header(hardware: str = MODELS_ONLY) -> dict:
    """What a result computed by dskit's models alone starts with: the command, the date, what it ran on."""
    return {
        "command": " ".join(["python", *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware,
    }


def header() -> dict:
    """What every result file starts with: the command, the date, the GPUs and the library versions."""
    import deepspeed
    import torch
    import transformers

    try:
        smi = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()
        )
    except FileNotFoundError:  # a machine without NVIDIA's driver: its CPU, and how many cores
        smi = [f"{_cpu_model()}, {os.cpu_count()} cores"]
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": smi,
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
            "torchao": _version("torchao"),  # FP8 training's kernels (dskit/train/fp8/compute.py)
        },
    }


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def step_records(run_dir: Path) -> list[dict]:
    """The trainer's per-step metrics of a rendered run directory (metrics.jsonl in its output dir)."""
    from dskit.plan.schema import load_plan

    metrics = Path(load_plan(run_dir / "run.yaml").run.output_dir) / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return [r for r in recs if "step_time_s" in r]


def steady(recs: list[dict], warmup_steps: int) -> dict:
    """Medians after the warm-up (compilation, allocator growth); memory peaks over every step."""
    after = [r for r in recs if r["step"] > warmup_steps]
    return {
        "step_s": round(statistics.median(r["step_time_s"] for r in after), 4),
        "tokens_per_s_per_gpu": round(statistics.median(r["tokens_per_s_per_gpu"] for r in after)),
        # no MFU where the device has no peak FLOP/s (a CPU dry run)
        "mfu": None
        if any(r["mfu"] is None for r in after)
        else round(statistics.median(r["mfu"] for r in after), 4),
        "real_tokens_per_s_per_gpu": round(statistics.median(r["real_tokens_per_s_per_gpu"] for r in after)),
        "packing_efficiency": round(statistics.median(r["packing_efficiency"] for r in after), 4),
        "peak_alloc_gib": max(r["peak_alloc_gib"] for r in recs),
        "peak_reserved_gib": max(r["peak_reserved_gib"] for r in recs),
        "loss_first": recs[0]["loss"],
        "loss_last": recs[-1]["loss"],
    }


def add_rows_args(ap, predict_help: str) -> None:
    """`--rows FILES [--predict]`: what the calibration tests run the bench scripts with. Missing files
    are a one-line argparse error, not a traceback."""

    def existing(text: str) -> Path:
        p = Path(text)
        if not p.is_file():
            raise argparse.ArgumentTypeError(f"{text}: no such result file")
        return p

    ap.add_argument(
        "--rows",
        nargs="+",
        type=existing,
        help="print result files' rows as JSON, as the calibration tests read them",
    )
    ap.add_argument("--predict", action="store_true", help=predict_help)


def ran_record(run_dir: Path) -> dict:
    """The trainer's `ran` record of a finished run (construction-rank0.json, dskit/train/entry.py)."""
    from dskit.plan.schema import load_plan

    out = load_plan(run_dir / "run.yaml").run.output_dir
    return json.loads(Path(out, "construction-rank0.json").read_text()).get("ran") or {}


def ran_otherwise(run_dir: Path) -> str | None:
    """Why a finished run is not a measurement of its plan: the attention kernel it fell back to, a
    compile it did not do, another optimizer step or gradient path (the trainer's `ran` record in construction-rank0.json,
    dskit/train/entry.py); None where it ran as planned. Benchmarks refuse such a row: each row says
    what ran, and only rows that ran the plan compare with it."""
    from dskit.plan.schema import load_plan

    plan = load_plan(run_dir / "run.yaml")
    p = plan.parallel
    ran = ran_record(run_dir)
    if not ran:
        return "the trainer recorded no `ran` (a trainer older than this check)"
    compiled = ran["compiled"]
    wrong = []
    if ran["attention"] != p.attention:
        wrong.append(f"attention {ran['attention']} (planned {p.attention})")
    if p.compile_regions and not (compiled.get("rms_norm") or compiled.get("swiglu_mlp")):
        wrong.append(f"compiled regions {compiled} (planned on)")
    if p.compile_attention and not compiled.get("attention"):
        wrong.append("attention not compiled (planned compiled)")
    if ran["optimizer_step"] != p.optimizer_step:
        wrong.append(f"optimizer step {ran['optimizer_step']} (planned {p.optimizer_step})")
    if p.zero_stage < 3 and ran.get("gradients", "buckets") != p.gradients:
        wrong.append(f"gradients {ran.get('gradients', 'buckets')} (planned {p.gradients})")
    if p.gradients == "flat" and ran.get("grad_first_write", "add") != p.grad_first_write:
        wrong.append(
            f"gradients landing by {ran.get('grad_first_write', 'add')} (planned {p.grad_first_write})"
        )
    combine = plan.deepspeed["expert_parallel"].get("combine_impl", "weighted_sum")
    if ran.get("moe_combine", ["weighted_sum"]) not in ([combine], []):
        wrong.append(f"MoE combine {ran.get('moe_combine')} (planned {combine})")
    if p.cuda_graphs and not compiled.get("cuda_graphs"):
        wrong.append("attention not in CUDA graphs (planned in graphs)")
    if p.cuda_graphs:
        skips = [r.get("cuda_graph_skips") for r in step_records(run_dir)]
        if not skips or None in skips:
            wrong.append("no cuda_graph_skips in its metrics (a trainer that does not count them)")
        elif max(skips):
            wrong.append(f"{max(skips)} compiled graph(s) without their CUDA graph (planned captured)")
    fp8 = ran.get("fp8") or {}
    planned = (p.fp8, p.fp8_experts, bool(p.fp8_linears))
    if (fp8.get("recipe"), bool(fp8.get("expert_layers")), bool(fp8.get("linears"))) != planned:
        wrong.append(
            f"fp8 {fp8 or 'off'} (planned {p.fp8 or 'off'}: {p.fp8_linears}, experts {p.fp8_experts})"
        )
    return "ran " + ", ".join(wrong) if wrong else None


def train(rd: Path) -> str:
    """`dskit train --local RD` to the end; its output. A failed run ends the script with its log's tail."""
    import os

    p = subprocess.run(
        [sys.executable, "-m", "dskit", "train", "--local", str(rd)],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent, env=dict(os.environ),
    )  # fmt: skip
    if p.returncode != 0:
        raise SystemExit(f"{rd.name} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    return p.stdout + p.stderr


#: when the trainer's ZeRO-1/2 fused step became one pass (dskit/train/adamw_cast.py) and a single rank
#: stopped using overlap_comm (dskit/plan/deepspeed.py): runs measured before it ran DeepSpeed's
#: cast and copy-back, its per-step flag read-back and two reduce buckets, and are re-predicted as such.
#: One file falls between the two: peer/h200-vs-torchtitan-overlap-2026-12-04.json ran the one pass with
#: overlap_comm still on (its variant row turned it off); it is in no calibration series.
ONE_PASS_SINCE = "2026-12-04T10:20"
#: when one rank's ZeRO-1/2 gradients went flat (dskit/train/flat_grads.py): runs measured
#: between the two ran the one pass through DeepSpeed's per-gradient hooks and buckets, whose micro-step
#: host time was fitted then at HOST_MICRO_STEP_BUCKETS_S
FLAT_SINCE = "2026-12-04T14:15"
HOST_MICRO_STEP_BUCKETS_S = 0.015
#: when the plan turned on AutoEP's fused combine for large micro-steps (dskit/plan/memory.py
#: `fused_combine`); runs before it combined eagerly at every size
FUSED_COMBINE_SINCE = "2026-12-04T15:00"
#: when a GPU's log records went a step late (dskit/train/metrics.py `LogWindow`) and the figures sent with
#: them reached the device from pinned memory (7a283b7, the first tree without a wait in the step): runs measured before it
#: waited for the GPU at each log step (every step in the benches), so one rank's optimizer did not overlap
#: the next step (speed.OPTIMIZER_OVERLAPS_NEXT_STEP), and their flat gradients' GPU time per layer pass
#: was fitted then at GPU_LAYER_PASS_FLAT_SYNCED_S (the waits' idle GPU included; docs/planner.md
#: "Small micro-steps")
DEFERRED_LOGS_SINCE = "2026-12-06T13:30"
GPU_LAYER_PASS_FLAT_SYNCED_S = 0.004


@contextmanager
def patched(module, **values):
    """The module's named constants set to `values` for the block, restored after it, also on an error."""
    old = {k: getattr(module, k) for k in values}
    try:
        for k, v in values.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def trainer_at(measured_at: str) -> str:
    """Which of the trainer's one-rank ZeRO-1/2 paths ran a run measured at `measured_at`: "flat"
    (flat gradients, since FLAT_SINCE), "one pass" (the one-pass step through DeepSpeed's hooks and
    buckets, since ONE_PASS_SINCE) or "deepspeed" (before)."""
    return (
        "flat" if measured_at >= FLAT_SINCE else "one pass" if measured_at >= ONE_PASS_SINCE else "deepspeed"
    )


@contextmanager
def as_measured(measured_at: str):
    """Today's step-time and memory model for a run measured at `measured_at` (its result file's date),
    or the model of the trainer that ran it: before DEFERRED_LOGS_SINCE, a step that waited for the GPU
    at each log step; before FUSED_COMBINE_SINCE, AutoEP's eager combine; before
    FLAT_SINCE, one rank's gradients through DeepSpeed's hooks and buckets, at the micro-step host time
    fitted then; before ONE_PASS_SINCE also its step without the one pass's saving, DeepSpeed's
    micro-step host time (HOST_MICRO_STEP_S) and two reduce buckets on one rank."""
    from dskit.plan import memory, speed

    in_speed: dict = {}
    in_memory: dict = {}
    if measured_at < FUSED_COMBINE_SINCE:
        in_memory["FUSED_COMBINE"] = False
    if measured_at < DEFERRED_LOGS_SINCE:
        in_speed |= {
            "OPTIMIZER_OVERLAPS_NEXT_STEP": False,
            "GPU_LAYER_PASS_FLAT_S": GPU_LAYER_PASS_FLAT_SYNCED_S,
        }
    if trainer_at(measured_at) != "flat":
        in_speed["HOST_MICRO_STEP_FUSED_S"] = HOST_MICRO_STEP_BUCKETS_S
        in_memory["FLAT_GRADIENTS"] = False
    if trainer_at(measured_at) == "deepspeed":
        in_speed |= {
            "ONE_PASS_SAVED_BYTES_PER_PARAM": 0.0,
            "HOST_MICRO_STEP_FUSED_S": speed.HOST_MICRO_STEP_S,
        }
        in_memory["ONE_RANK_REDUCE_BUCKETS"] = 2
    with patched(speed, **in_speed), patched(memory, **in_memory):
        yield


def cuda_median_s(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median seconds of fn() on the GPU over `iters` calls after `warmup` (the first may compile), each
    timed by CUDA events around it."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]
