"""dskit beside torchtitan on one GPU, in the same call: the peer an expert would pick instead.

torchtitan's `deepseek_v3` flavor `16B` is DeepSeek-V2-Lite's shape; the runner in
shared/reference/torchtitan/ (tt_run.py, base.toml, make_assets.py) registers 4-, 6- and 12-layer
flavors. The shapes (4 layers): micro-batch 1 and 2 at seq 2048 and 4096, one micro-batch per step
(global batch = micro-batch: where the host, not the GPU, sets the pace), and global batch 16 at seq
4096 (dskit: the plan's pick; torchtitan: local batch 16). torchtitan runs without activation
checkpointing with model and loss compiled (its fastest setting in the earlier measurement); dskit
runs the plan's pick with the micro-batch pinned where the row names one. Both through their own
launchers: dskit's real path (spec -> plan -> `dskit train --local`) and torchtitan's trainer under
torchrun. A dskit row that did not run what its plan says (an attention kernel that fell back, a
compile not done, another optimizer step) is refused: it carries `error`, no figures.

One MFU formula for both: tokens/s/GPU x dskit's FLOPs per token of that shape (6 x active parameters +
causal attention, dskit/plan/model_math.py) / the GPU's dense bf16 peak (gpus.yaml). Peak memory: the
allocator's peak reserved (dskit's metrics; torchtitan's `memory:` log, max reserved).

    python3 bench/peer_bench.py --torchtitan DIR --out $OUT/h200-vs-torchtitan-DATE.json --work /tmp/pb
    python3 bench/peer_bench.py --torchtitan DIR --profile "L4 s2048 mb2" --out ... --work ...

`--host-bound` runs HOST_BOUND instead: one micro-batch per step at seq 1024-4096 and 3-8 layers;
`--lever overrides.cuda_graphs=on` adds a dskit row per shape with that set, in the same call. torchtitan runs through TT_RUNNER (the reference runner,
with any layer count), written into the work dir.

DIR holds base.toml (ASSETS replaced by the assets' path) and the assets; torchtitan's wheels
go on TT_PYTHONPATH, kept apart from dskit's (torchtitan's README in shared/reference;
bench/device_bundle.sh with TT_REF carries all of it).
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

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import runs, train_bench  # noqa: E402

GPU = "h200-141gb"
#: bench/log_hook: the trainer's log records written at their own step (--at-step-logs)
LOG_HOOK = Path(__file__).resolve().parent / "log_hook"
TT_STEPS = 12
TT_WARMUP = 4  # torchtitan's first steps compile; medians of the rest
#: (row name, layers, seq, global batch, micro-batch pinned or None for the plan's pick)
SHAPES = [
    ("L4 s2048 mb1", 4, 2048, 1, 1),
    ("L4 s2048 mb2", 4, 2048, 2, 2),
    ("L4 s4096 mb1", 4, 4096, 1, 1),
    ("L4 s4096 mb2", 4, 4096, 2, 2),  # the reference shape
    ("L4 s4096 gb16", 4, 4096, 16, None),
]
#: --host-bound: one micro-batch per step at short sequences and few layers, where the host sets the pace
HOST_BOUND = [
    ("L6 s1024 mb2", 6, 1024, 2, 2),
    ("L3 s4096 mb1", 3, 4096, 1, 1),
    ("L8 s2048 mb1", 8, 2048, 1, 1),
    ("L4 s2048 mb2", 4, 2048, 2, 2),
    ("L4 s1024 mb1", 4, 1024, 1, 1),
    ("L8 s1024 mb2", 8, 1024, 2, 2),
]
#: torchtitan's runner (as shared/reference/torchtitan/tt_run.py), registering the layer counts asked for
TT_RUNNER = """import copy
import torchtitan.models.deepseek_v3 as d
for n in {layers}:
    a = copy.deepcopy(d.deepseekv3_args["16B"]); a.n_layers = n; d.deepseekv3_args[f"16B_L{{n}}"] = a
from torchtitan.train import Trainer, main
main(Trainer)
"""


def flops_per_token(layers: int, seq: int) -> float:
    from dskit import catalog
    from dskit.plan.model_math import counts
    from dskit.plan.model_math import flops_per_token as fpt
    from dskit.plan.shape import ModelShape

    cfg = dict(catalog.model("deepseek-v2-lite").config, num_hidden_layers=layers)
    return fpt(counts(ModelShape.from_config(cfg), seq))


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
    from dskit.train.profile import gpu_busy, host_table, kernel_table, trace_kernels

    trace = json.loads(next(dump.glob("profile_traces/iteration_*/rank0_trace.json")).read_text())
    return {
        "profile": kernel_table(trace_kernels(trace), 3),
        "gpu_busy": gpu_busy(trace),
        "host": host_table(trace, 3),
    }


def run_torchtitan(tt: Path, name: str, layers: int, seq: int, flags: list[str], work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.environ.get("TT_PYTHONPATH", "")}
    runner = work / f"tt_run_L{layers}.py"
    runner.write_text(TT_RUNNER.format(layers=(layers,)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(runner),
        "--job.config_file",
        str(tt / "base.toml"),
        "--model.flavor",
        f"16B_L{layers}",
        "--training.seq_len",
        str(seq),
        "--training.steps",
        str(TT_STEPS),
        *flags,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env)
    log = proc.stdout + proc.stderr
    (work / f"torchtitan-{name.replace(' ', '-')}.log").write_text(log)
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


def repredict(row: dict, date: str) -> dict:
    """Today's plan for a measured dskit row's shape, at the micro-batch it ran, on the GPU profile its
    call planned on (`_gpu`; the model of the trainer that ran it: runs.as_measured): memory GiB and
    tokens/s/GPU."""
    from dskit.plan.build import build_plan

    sets = [
        f"model.num_layers={row['layers']}",
        f"training.seq_len={row['seq_len']}",
        f"training.global_batch={row['global_batch']}",
        f"overrides.micro_batch={row['micro_batch']}",
        *row.get("sets", []),
    ]
    with runs.as_measured(date), runs.patched(train_bench, GPU=row.get("_gpu", GPU)):
        plan = build_plan(train_bench.spec_for(row["shape"], sets, Path("/nonexistent"), 1))
    return {
        "memory_gib": plan.memory["total_gib"],
        "tokens_per_s_per_gpu": plan.speed["tokens_per_s_per_gpu"],
    }


def planned_on(command: str) -> str:
    """The GPU profile a call's dskit rows were planned on: its `--gpu`, else the default."""
    m = re.search(r"--gpu[ =](\S+)", command)
    return m.group(1) if m else GPU


def derived(files: list[Path], predict: bool, system: str = "dskit") -> list[dict]:
    """`--rows`: the measured dskit rows at the plan's own config (no variant, no error) as the
    calibration tests read them, with `_source`, `_index`, `_date`, `_trainer` (runs.trainer_at) and `_gpu`;
    `predict`: also `_predicted`. `system`: another row of the same calls (`dskit, logs at their step`)."""
    out = []
    for f in files:
        d = json.loads(f.read_text())
        mine = [r for r in d["rows"] if r["system"] == system and r.get("tok_s_gpu")]
        for i, r in enumerate(mine):
            row = {
                **r,
                "_source": str(f.resolve().relative_to(runs.RESULTS)),
                "_index": i,
                "_date": d["date"],
                "_trainer": runs.trainer_at(d["date"]),  # which one-rank path ran it
                "_gpu": planned_on(d["command"]),
            }
            if predict:
                row["_predicted"] = repredict(row, d["date"])
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torchtitan", type=Path, help="dir with tt_run.py, base.toml, assets")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path)
    runs.add_rows_args(ap, "with --rows: each dskit row with today's plan for its shape (`_predicted`)")
    names = list(dict.fromkeys(x[0] for x in SHAPES + HOST_BOUND))
    ap.add_argument("--only", action="append", choices=names, help="run only these shapes (repeatable)")
    ap.add_argument("--host-bound", action="store_true", help="the HOST_BOUND shapes instead of SHAPES")
    ap.add_argument("--gpu", default=GPU, help=f"the GPU's catalog profile (default {GPU})")
    ap.add_argument(
        "--profile",
        choices=names,
        help="only this shape, both profiled: GPU time by kernel category and how busy the GPU was",
    )
    ap.add_argument("--set", action="append", default=[], help="a spec --set for every dskit row (a lever)")
    ap.add_argument(
        "--lever",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more dskit row per shape with this spec --set added (a plan lever against the plan's "
        "default, in the same call), e.g. overrides.cuda_graphs=on",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="one more dskit row per shape with this DeepSpeed config value patched into run.yaml (a lever "
        "against the plan's, in the same call; VALUE as YAML), e.g. bf16.check_grad_overflow=true",
    )
    ap.add_argument(
        "--at-step-logs",
        action="store_true",
        help="one more dskit row per shape whose log records are written at their own step, the GPU's "
        "figures read at once (bench/log_hook), against the plan's records a log step late",
    )
    a = ap.parse_args()
    if a.rows:
        print(json.dumps(derived(a.rows, a.predict)))
        return
    if not (a.torchtitan and a.out and a.work):
        ap.error("--torchtitan, --out and --work are required to measure")
    a.torchtitan = a.torchtitan.resolve()  # torchtitan runs in the work dir
    from dskit import catalog

    train_bench.GPU = a.gpu  # the profile spec_for plans the dskit rows on
    (a.work / "dskit").mkdir(parents=True, exist_ok=True)
    peak = catalog.gpu(a.gpu).peak_tflops_bf16 * 1e12
    result = {**runs.header(), "mfu_formula": "tok_s_gpu x dskit flops_per_token / bf16 peak", "rows": []}

    def record(row: dict) -> None:
        if row.get("tok_s_gpu"):
            row["mfu"] = round(row["tok_s_gpu"] * flops_per_token(row["layers"], row["seq_len"]) / peak, 4)
        result["rows"].append(row)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(
            json.dumps({k: v for k, v in row.items() if k not in ("losses", "error", "profile")}), flush=True
        )

    shapes = HOST_BOUND if a.host_bound else SHAPES
    wanted = [a.profile] if a.profile else (a.only or [x[0] for x in shapes])
    for name, layers, seq, gb, mb in dict.fromkeys(SHAPES + HOST_BOUND):
        if name not in wanted:
            continue
        sets = [f"model.num_layers={layers}", f"training.seq_len={seq}", f"training.global_batch={gb}"]
        sets += [f"overrides.micro_batch={mb}"] if mb else []
        tt_flags = ["--training.local_batch_size", str(mb or gb), "--training.global_batch_size", str(gb)]
        if a.profile:
            sets.append("training.profile_steps=3")
            tt_flags += [*TT_PROFILE, "--job.dump_folder", str(a.work / "tt-profile")]
        base = {"shape": name, "global_batch": gb, "layers": layers, "seq_len": seq}
        d = train_bench.run_dskit(name, [*sets, *a.set], {}, a.work / "dskit", 1)
        plan_mb = re.search(r"micro-batch (\d+)", d.get("plan") or "")
        record(
            {
                "system": "dskit",
                **base,
                "micro_batch": int(plan_mb.group(1)) if plan_mb else mb,
                "tok_s_gpu": d.get("tok_s_gpu"),
                "step_s": d.get("step_s"),
                "peak_gib": d.get("peak_reserved_gb"),
                "attention": d.get("attention"),
                "plan": d.get("plan"),
                "sets": a.set,
                # per step: a lever's run compares its loss curve with the plan's (same data, same seed)
                **{k: d[k] for k in ("losses", "profile", "gpu_busy", "host", "error") if k in d},
            }
        )
        for lever in a.lever:
            d = train_bench.run_dskit(f"{name} {lever}", [*sets, *a.set, lever], {}, a.work / "dskit", 1)
            record(
                {
                    "system": f"dskit, {lever}",
                    **base,
                    "micro_batch": mb,
                    "tok_s_gpu": d.get("tok_s_gpu"),
                    "step_s": d.get("step_s"),
                    "peak_gib": d.get("peak_reserved_gb"),
                    "attention": d.get("attention"),
                    "plan": d.get("plan"),
                    "sets": [*a.set, lever],
                    **{k: d[k] for k in ("losses", "profile", "gpu_busy", "host", "error") if k in d},
                }
            )
        if a.at_step_logs:
            hook = os.pathsep.join(x for x in (str(LOG_HOOK), os.environ.get("PYTHONPATH")) if x)
            env = {"PYTHONPATH": hook, "DSKIT_BENCH_LOG_RECORDS": "at-step"}
            d = train_bench.run_dskit(
                f"{name} at-step logs", [*sets, *a.set], {}, a.work / "dskit", 1, env=env
            )
            record(
                {
                    "system": "dskit, logs at their step",
                    **base,
                    "micro_batch": mb,
                    "tok_s_gpu": d.get("tok_s_gpu"),
                    "step_s": d.get("step_s"),
                    "peak_gib": d.get("peak_reserved_gb"),
                    "sets": a.set,
                    **{k: d[k] for k in ("losses", "profile", "gpu_busy", "host", "error") if k in d},
                }
            )
        for v in a.variant:
            key, _, value = v.partition("=")
            section, _, field = key.partition(".")
            patch = {section: {field: yaml.safe_load(value)}}
            d = train_bench.run_dskit(f"{name} {v}", [*sets, *a.set], patch, a.work / "dskit", 1)
            record(
                {
                    "system": f"dskit, {v}",
                    **base,
                    "micro_batch": mb,
                    "tok_s_gpu": d.get("tok_s_gpu"),
                    "step_s": d.get("step_s"),
                    "peak_gib": d.get("peak_reserved_gb"),
                    "deepspeed_patch": patch,
                    **{k: d[k] for k in ("losses", "profile", "gpu_busy", "host", "error") if k in d},
                }
            )
        t = run_torchtitan(a.torchtitan, name, layers, seq, tt_flags, a.work)
        record({"system": "torchtitan", **base, "micro_batch": mb or gb, **t})
    for r in result["rows"]:
        if "profile" in r:
            busy = r.get("gpu_busy") or {}
            print(
                f"\n{r['system']}: {r['profile']['ms_per_step']} ms/step of GPU kernels; GPU busy {busy.get('busy')}"
            )
            for k, v in r["profile"]["categories"].items():
                print(f"  {k:40s} {v['ms_per_step']:8.2f} ms  {100 * v['share']:5.1f}%")
            h = r.get("host") or {}
            print(
                f"  host: {h.get('launches_per_step')} launches/step, {h.get('sync_calls_per_step')} syncs/step, "
                f"{h.get('host_blocked_ms_per_step')} ms/step blocked"
            )
            for k, v in (h.get("runtime_calls") or {}).items():
                print(f"    {k:50s} {v['calls']:8.1f} x {v['ms']:8.3f} ms")
            for k, v in list((h.get("cpu_ops_inclusive") or {}).items())[:10]:
                print(f"    op {k:47s} {v['calls']:8.1f} x {v['ms']:8.3f} ms")
    print(
        f"\n{'shape':16s} {'dskit tok/s':>12s} {'torchtitan':>12s} {'ratio':>6s} {'dskit GiB':>10s} {'tt GiB':>8s}"
    )
    for name in wanted:
        rows = {r["system"]: r for r in result["rows"] if r["shape"] == name and r.get("tok_s_gpu")}
        t = rows.pop("torchtitan", None)
        for system, d in rows.items() if t else ():
            print(
                f"{name:16s} {d['tok_s_gpu']:12,.0f} {t['tok_s_gpu']:12,.0f} {d['tok_s_gpu'] / t['tok_s_gpu']:5.2f}x"
                f" {d['peak_gib'] or 0:10.1f} {t['peak_gib'] or 0:8.1f}  {system}"
            )


if __name__ == "__main__":
    main()
