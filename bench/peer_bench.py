"""dskit beside torchtitan on one GPU, in the same call: the peer an expert would pick instead (issue 25).

torchtitan's `deepseek_v3` flavor `16B` is DeepSeek-V2-Lite's shape; the runner in
shared/reference/torchtitan/ (tt_run.py, base.toml, make_assets.py) registers 4-, 6- and 12-layer
flavors. Two shapes, 4 layers, seq 4096: the reference shape (2 sequences per GPU per step) and global
batch 16 (dskit: the plan's pick; torchtitan: local batch 16, no activation checkpointing, model and
loss compiled, its fastest setting in the earlier measurement). Both through their own launchers:
dskit's real path (spec -> plan -> `dskit train --local`) and torchtitan's trainer under torchrun.

One MFU formula for both: tokens/s/GPU x dskit's FLOPs per token of that shape (6 x active parameters +
causal attention, dskit/plan/model_math.py) / the GPU's dense bf16 peak (gpus.yaml). Peak memory: the
allocator's peak reserved (dskit's metrics; torchtitan's `memory:` log, max reserved).

    python3 bench/peer_bench.py --torchtitan DIR --out $OUT/h200-vs-torchtitan-DATE.json --work /tmp/pb

DIR holds tt_run.py, base.toml (ASSETS replaced by the assets' path) and the assets; torchtitan's wheels
go on TT_PYTHONPATH, kept apart from dskit's (torchtitan's README in shared/reference).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import runs  # noqa: E402  (bench/runs.py, beside this script)
import train_bench  # noqa: E402

LAYERS, SEQ = 4, 4096
GPU = "h200-141gb"
TT_STEPS = 12
TT_WARMUP = 4  # torchtitan's first steps compile; medians of the rest
#: (row name, global batch, dskit spec sets, torchtitan flags)
SHAPES = [
    ("reference shape", 2, [], ["--training.local_batch_size", "2", "--training.global_batch_size", "2"]),
    (
        "global batch 16",
        16,
        [],
        ["--training.local_batch_size", "16", "--training.global_batch_size", "16"],
    ),
]


def flops_per_token() -> float:
    from dskit import catalog
    from dskit.plan.model_math import counts
    from dskit.plan.model_math import flops_per_token as fpt

    cfg = dict(catalog.model("deepseek-v2-lite").config, num_hidden_layers=LAYERS)
    return fpt(counts(cfg, SEQ))


#: torchtitan's profiler: steps 8-10 of 12 (wait 5, warm-up 2, active 3), one Chrome trace
TT_PROFILE = [
    "--profiling.enable_profiling",
    "--profiling.profile_freq",
    "10",
    "--profiling.profiler_warmup",
    "2",
    "--profiling.profiler_active",
    "3",
]


def tt_profile(dump: Path) -> dict:
    """torchtitan's trace cut by dskit's kernel categories (dskit/train/profile.py), and how busy the GPU was."""
    from dskit.train.profile import gpu_busy, kernel_table, trace_kernels

    trace = json.loads(next(dump.glob("profile_traces/iteration_*/rank0_trace.json")).read_text())
    return {"profile": kernel_table(trace_kernels(trace), 3), "gpu_busy": gpu_busy(trace)}


def run_torchtitan(tt: Path, flags: list[str], work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.environ.get("TT_PYTHONPATH", "")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(tt / "tt_run.py"),
        "--job.config_file",
        str(tt / "base.toml"),
        "--model.flavor",
        f"16B_L{LAYERS}",
        "--training.seq_len",
        str(SEQ),
        "--training.steps",
        str(TT_STEPS),
        *flags,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env)
    log = proc.stdout + proc.stderr
    (work / f"torchtitan-{flags[1]}.log").write_text(log)
    if proc.returncode != 0:
        return {"error": log[-3000:]}
    tps = [float(x.replace(",", "")) for x in re.findall(r"tps: ([\d,]+)", log)]
    mem = [float(x) for x in re.findall(r"memory: ([\d.]+)GiB", log)]
    steady = tps[TT_WARMUP:]
    dump = next((Path(x) for x in re.findall(r"--job.dump_folder (\S+)", " ".join(flags))), None)
    return {
        **(tt_profile(dump) if dump else {}),
        "tok_s_gpu": round(statistics.median(steady)),
        "peak_gib": max(mem) if mem else None,
        "steps_measured": len(steady),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torchtitan", type=Path, required=True, help="dir with tt_run.py, base.toml, assets")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="only the reference shape, both profiled: GPU time by kernel category and how busy the GPU was",
    )
    a = ap.parse_args()
    a.torchtitan = a.torchtitan.resolve()  # torchtitan runs in the work dir
    from dskit import catalog

    (a.work / "dskit").mkdir(parents=True, exist_ok=True)
    peak = catalog.gpu(GPU).peak_tflops_bf16 * 1e12
    fpt = flops_per_token()
    result = {**runs.header(), "mfu_formula": "tok_s_gpu x dskit flops_per_token / bf16 peak", "rows": []}

    def record(row: dict) -> None:
        if "tok_s_gpu" in row:
            row["mfu"] = round(row["tok_s_gpu"] * fpt / peak, 4)
        result["rows"].append(row)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "error")}), flush=True)

    shapes = SHAPES
    if a.profile:
        name, gb, sets, tt_flags = SHAPES[0]
        dump = a.work / "tt-profile"
        shapes = [
            (
                name,
                gb,
                [*sets, "training.profile_steps=3"],
                [*tt_flags, *TT_PROFILE, "--job.dump_folder", str(dump)],
            )
        ]
    for name, gb, sets, tt_flags in shapes:
        base = {"shape": name, "global_batch": gb, "layers": LAYERS, "seq_len": SEQ}
        d = train_bench.run_dskit(name, [f"training.global_batch={gb}", *sets], {}, a.work / "dskit", 1)
        record(
            {
                "system": "dskit",
                **base,
                "micro_batch": int(re.search(r"micro-batch (\d+)", d.get("plan", "micro-batch 0")).group(1)),
                "tok_s_gpu": d.get("tok_s_gpu"),
                "peak_gib": d.get("peak_reserved_gb"),
                "plan": d.get("plan"),
                **{k: d[k] for k in ("profile", "gpu_busy", "error") if k in d},
            }
        )
        t = run_torchtitan(a.torchtitan, tt_flags, a.work)
        record({"system": "torchtitan", **base, "micro_batch": int(tt_flags[1]), **t})
    for r in result["rows"]:
        if "profile" in r:
            busy = r.get("gpu_busy") or {}
            print(
                f"\n{r['system']}: {r['profile']['ms_per_step']} ms/step of GPU kernels; GPU busy {busy.get('busy')}"
            )
            for k, v in r["profile"]["categories"].items():
                print(f"  {k:40s} {v['ms_per_step']:8.2f} ms  {100 * v['share']:5.1f}%")
    for name, _, _, _ in shapes:
        rows = {r["system"]: r for r in result["rows"] if r["shape"] == name and r.get("tok_s_gpu")}
        if len(rows) == 2:
            print(
                f"{name}: dskit / torchtitan = {rows['dskit']['tok_s_gpu'] / rows['torchtitan']['tok_s_gpu']:.2f}x"
            )


if __name__ == "__main__":
    main()
