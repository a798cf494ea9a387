"""GPU benchmark of sharded construction: full-depth DeepSeek-V2-Lite built on N GPUs, then training.

1. What the plan says for the full model on this machine (its real host memory): fits, or refused.
2. Full depth (27 layers, 15.7 B parameters), EP = N: each rank builds the model under ZeRO-3 partitioning
   and starts the engine (AutoEP re-partitions the experts) without an optimizer, so the measured peaks
   are construction alone; beside them the plan's construction estimate and the whole model's size.
3. Training steps with the plan's own settings on a depth that the machine can train (`--train-layers`),
   through `dskit train --local`: steady-state peak beside the plan's estimate, tokens/s/GPU, MFU.

    python bench/construction_bench.py --gpus 2 --host-gib 256 --out RESULT.json --work /tmp/w
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import runs  # noqa: E402  (bench/runs.py, beside this script)

GPU = "h200-141gb"
MODEL = "deepseek-v2-lite"


def spec_flags(name: str, gpus: int, work: Path) -> dict:
    return {
        "hardware.gpu": GPU,
        "hardware.gpus_per_node": gpus,
        "model.preset": MODEL,
        "runtime.kind": "none",
        "storage.root": str(work / "storage"),
        "name": name,
    }


def render(name: str, sets: list[str], gpus: int, work: Path) -> Path:
    from dskit.render.run_dir import render_run
    from dskit.spec import load_spec

    return render_run(load_spec(sets=sets, flags=spec_flags(name, gpus, work)), "slurm", work / name).out


def plan_verdict(sets: list[str], gpus: int, work: Path) -> dict:
    """`dskit plan` as a user runs it: exit code and its one line (refusal) or summary."""
    args = [
        sys.executable,
        "-m",
        "dskit",
        "plan",
        "--gpu",
        GPU,
        "--model",
        MODEL,
        "--gpus-per-node",
        str(gpus),
    ]
    for s in sets:
        args += ["--set", s]
    p = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    lines = (p.stderr if p.returncode else p.stdout).strip().splitlines()
    return {"command": " ".join(args[1:]), "exit": p.returncode, "says": lines[-1] if lines else ""}


def construction_worker(run_dir: str) -> None:
    """One rank of step 2: build + engine without an optimizer, then exit."""
    os.environ["DSKIT_RUN_FILE"] = str(Path(run_dir, "run.yaml"))
    from dskit.train.entry import build_engine, read_contract, setup_logging, start_distributed

    setup_logging(int(os.environ["RANK"]))
    plan, *_ = read_contract()
    ds = json.loads(json.dumps(plan.deepspeed))
    ds.pop("optimizer", None)
    ds["zero_optimization"].pop("offload_optimizer", None)
    device, rank, _ = start_distributed(plan)
    build_engine(plan, device, rank=rank, deepspeed_config=ds)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def torchrun(run_dir: Path, gpus: int, module_args: list[str], log: Path) -> int:
    from dskit.plan.schema import load_plan

    plan = load_plan(run_dir / "run.yaml")
    env = {**os.environ, **plan.env, "DSKIT_RUN_FILE": str(run_dir / "run.yaml")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        *module_args,
    ]
    with log.open("w") as f:
        return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode


def construction_records(run_dir: Path) -> list[dict]:
    from dskit.plan.schema import load_plan

    out = Path(load_plan(run_dir / "run.yaml").run.output_dir)
    return sorted(
        (json.loads(p.read_text()) for p in out.glob("construction-rank*.json")), key=lambda r: r["rank"]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--host-gib", type=float, required=True, help="this machine's host RAM (GiB)")
    ap.add_argument("--train-layers", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        construction_worker(a.worker)
        return 0
    from dskit.plan.schema import load_plan

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    base = [f"training.seq_len={a.seq_len}", f"training.global_batch={4 * a.gpus}"]
    host = [f"hardware.host_memory_gib={a.host_gib:g}"]
    result: dict = {**runs.header(), "host": platform.node()}
    result["plan_full_depth_this_host"] = plan_verdict([*base, *host], a.gpus, work)
    print("plan, full depth, this host:", result["plan_full_depth_this_host"]["says"], flush=True)

    # 2. full-depth construction. A roomier host is assumed only so that a plan exists to read the
    # construction estimate from; no optimizer is built, so no host memory for offload is used.
    full = render("full-depth", [*base, "hardware.host_memory_gib=4096", "training.steps=1"], a.gpus, work)
    plan = load_plan(full / "run.yaml")
    rc = torchrun(
        full,
        a.gpus,
        [
            str(Path(__file__).resolve()),
            "--work",
            a.work,
            "--out",
            a.out,
            "--host-gib",
            "0",
            "--worker",
            str(full),
        ],
        work / "construction.log",
    )
    result["construction"] = {
        "exit": rc,
        "layers": plan.model.config["num_hidden_layers"],
        "params_total": plan.model.params_total,
        "whole_model_bf16_gib": round(2 * plan.model.params_total / 2**30, 2),
        "plan_construction_gib": plan.memory.get("construction_gib"),
        "plan_memory": plan.memory,
        "ranks": construction_records(full),
    }
    print(json.dumps(result["construction"]["ranks"]), flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1))

    # 3. training at the plan's settings on a depth this host can train
    sets = [
        *base,
        *host,
        f"model.num_layers={a.train_layers}",
        f"training.steps={a.steps}",
        "training.log_every=1",
        "checkpoint.every=100000",
        "checkpoint.final=false",
    ]
    result["plan_train_depth"] = plan_verdict(sets, a.gpus, work)
    train_dir = render("train-depth", sets, a.gpus, work)
    tplan = load_plan(train_dir / "run.yaml")
    log = work / "train.log"
    rc = subprocess.run(
        [sys.executable, "-m", "dskit", "train", "--local", str(train_dir)],
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    ).returncode
    metrics = (
        [json.loads(x) for x in (Path(tplan.run.output_dir) / "metrics.jsonl").read_text().splitlines()]
        if (Path(tplan.run.output_dir) / "metrics.jsonl").is_file()
        else []
    )
    steady = metrics[3:] or metrics
    result["training"] = {
        "exit": rc,
        "summary": tplan.summary(),
        "plan_memory": tplan.memory,
        "ranks": construction_records(train_dir),
        "losses": [m["loss"] for m in metrics],
        "tokens_per_s_per_gpu": statistics.median(m["tokens_per_s_per_gpu"] for m in steady)
        if steady
        else None,
        "mfu": statistics.median(m["mfu"] for m in steady) if steady else None,
        "peak_alloc_gib": max((m["peak_alloc_gib"] for m in metrics), default=None),
        "peak_reserved_gib": max((m["peak_reserved_gib"] for m in metrics), default=None),
        "log_tail": log.read_text()[-3000:] if rc else "",
    }
    Path(a.out).write_text(json.dumps(result, indent=1))
    c, t = result["construction"], result["training"]
    print(
        f"\nfull depth {c['layers']} layers, {c['params_total'] / 1e9:.2f} B params ({c['whole_model_bf16_gib']} GiB bf16), plan construction estimate {c['plan_construction_gib']} GiB"
    )
    print(
        "| rank | params held | build peak GiB | build s | engine peak alloc GiB | reserved GiB | host RSS GiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in c["ranks"]:
        print(
            f"| {r['rank']} | {r['params_local'] / 1e9:.2f} B | {r['build_peak_alloc_gib']} | {r['build_s']} | {r['peak_alloc_gib']} | {r['peak_reserved_gib']} | {r['host_rss_gib']} |"
        )
    print(f"\ntraining ({a.train_layers} layers): {t['summary']}; exit {t['exit']}")
    print(
        f"plan steady {t['plan_memory'].get('total_gib')} GiB, measured peak alloc {t['peak_alloc_gib']} reserved {t['peak_reserved_gib']}; {t['tokens_per_s_per_gpu']} tok/s/GPU, MFU {t['mfu']}; losses {t['losses']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
