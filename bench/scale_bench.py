"""GPU benchmark of expert-parallel scaling on the GPUs a machine has: DeepSeek-V2-Lite layers holding the experts per
GPU that EP 8 gives the full model (64 / 8 = 8), from 1 to N GPUs at the same per-GPU work, against the
plan; then one preemption (USR1 to the launcher) and a resume with the same command.

Per GPU count G: the V2-Lite config with `--layers` layers and 8*G routed experts (top-6 of them per
token, as the full model), EP = G, ZeRO-3, micro-batch `--micro-batch`, seq `--seq-len`: every GPU holds
8 experts per layer and computes the same tokens, as on 8 GPUs with the full 64. Each run goes through
the real path: plan -> rendered run dir -> `dskit train --local` (the torchrun words of the Slurm render).

1. scaling: tokens/s/GPU and MFU (median after the warm-up), peak memory in construction and in steady
   state against the plan's predictions;
2. where the step goes at G > 1: a profiled run (`training.profile_steps`), kernel time by category, the
   all-to-all (MoE dispatch/combine) and ZeRO-3 all-gather / reduce-scatter shares among them;
3. at the largest G: USR1 to `dskit train --local` at `--preempt-at`, which must checkpoint and exit 75;
   the same command then resumes, and its losses are compared with the uninterrupted run of step 1.

    python3 bench/scale_bench.py --gpus 1,2 --layers 8 --steps 50 --out RESULT.json --work /tmp/s
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import runs  # noqa: E402  (bench/runs.py, beside this script)

GPU = "h200-141gb"
EXPERTS_PER_GPU_AT_EP8 = 64 // 8
WARMUP_STEPS = 5
EXIT_REQUEUE = 75


def write_config(work: Path, layers: int, experts: int) -> Path:
    from dskit import catalog

    cfg = dict(catalog.models()["deepseek-v2-lite"].config)
    cfg.update(num_hidden_layers=layers, n_routed_experts=experts)
    path = work / f"v2-lite-{layers}l-{experts}e" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))
    return path


def render(name: str, gpus: int, sets: list[str], work: Path) -> Path:
    from dskit.render.run_dir import render_run
    from dskit.spec import load_spec

    flags = {
        "hardware.gpu": GPU,
        "hardware.gpus_per_node": gpus,
        "runtime.kind": "none",
        "storage.root": str(work / "storage"),
        "name": name,
    }
    return render_run(load_spec(sets=sets, flags=flags), "slurm", work / name).out


def launch(run_dir: Path, log: Path) -> subprocess.Popen:
    f = log.open("a")
    cmd = [sys.executable, "-m", "dskit", "train", "--local", str(run_dir)]
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=None)


def run_to_end(run_dir: Path, log: Path) -> int:
    return launch(run_dir, log).wait()


def output_dir(run_dir: Path) -> Path:
    from dskit.plan.schema import load_plan

    return Path(load_plan(run_dir / "run.yaml").run.output_dir)


def predictions(run_dir: Path) -> dict:
    from dskit.plan.schema import load_plan

    plan = load_plan(run_dir / "run.yaml")
    return {"summary": plan.summary(), "memory": plan.memory, "speed": plan.speed}


def construction(run_dir: Path) -> list[dict]:
    return sorted(
        (json.loads(p.read_text()) for p in output_dir(run_dir).glob("construction-rank*.json")),
        key=lambda r: r["rank"],
    )


def losses(run_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in runs.step_records(run_dir):
        out[r["step"]] = r["loss"]  # a step logged twice (resume) keeps its last value
    return out


def torchrun_line(log: Path) -> str | None:
    for line in log.read_text().splitlines():
        if line.startswith("+ ") and "dskit.launch.torchrun" in line:
            return line[2:]
    return None


def preempt(run_dir: Path, log: Path, at_step: int, timeout_s: float) -> dict:
    """USR1 to the launcher once `at_step` is logged; the launcher must exit 75, the same command resume."""
    p = launch(run_dir, log)
    metrics = output_dir(run_dir) / "metrics.jsonl"
    t0 = time.monotonic()
    while p.poll() is None and time.monotonic() - t0 < timeout_s:
        if metrics.is_file() and any(s >= at_step for s in losses(run_dir)):
            break
        time.sleep(0.5)
    signalled = p.poll() is None
    if signalled:
        p.send_signal(signal.SIGUSR1)
    rc = p.wait()
    stopped = max(losses(run_dir), default=0)
    t_resume = time.monotonic()
    rc2 = run_to_end(run_dir, log)
    text = log.read_text()
    return {
        "signalled_at_step": at_step if signalled else None,
        "launcher_exit": rc,
        "checkpointed_step": stopped,
        "resume_exit": rc2,
        "resumed_from_log": next((x for x in text.splitlines() if "resumed from" in x), None),
        "resume_wall_s": round(time.monotonic() - t_resume, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--gpus", default="1,2", help="GPU counts to run, comma-separated (the last is preempted)"
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--preempt-at", type=int, default=25)
    ap.add_argument("--no-preempt", action="store_true", help="only the scaling runs (step 1, 2)")
    ap.add_argument("--host-gib", type=float, default=256)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    counts = [int(x) for x in a.gpus.split(",")]
    result: dict = {
        **runs.header(),
        "shape": (
            f"DeepSeek-V2-Lite config, {a.layers} layers, {EXPERTS_PER_GPU_AT_EP8} routed experts per GPU "
            f"(8*G in all, top-6), EP = G, ZeRO-3, seq {a.seq_len}, micro-batch {a.micro_batch} per GPU"
        ),
        "scaling": [],
    }

    def save() -> None:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")

    def sets_for(g: int, cfg: Path, steps: int, extra: list[str]) -> list[str]:
        return [
            f"model.path={cfg}",
            f"training.seq_len={a.seq_len}",
            f"training.global_batch={a.micro_batch * g}",
            f"training.steps={steps}",
            "training.log_every=1",
            f"overrides.micro_batch={a.micro_batch}",
            f"overrides.ep_size={g}",
            f"hardware.host_memory_gib={a.host_gib:g}",
            *extra,
        ]

    for g in counts:
        cfg = write_config(work, a.layers, EXPERTS_PER_GPU_AT_EP8 * g)
        no_ckpt = ["checkpoint.every=100000", "checkpoint.final=false"]
        rd = render(f"scale-{g}gpu", g, sets_for(g, cfg, a.steps, no_ckpt), work)
        log = work / f"scale-{g}gpu.log"
        rc = run_to_end(rd, log)
        row: dict = {"gpus": g, "experts": EXPERTS_PER_GPU_AT_EP8 * g, "exit": rc, "plan": predictions(rd)}
        row["torchrun"] = torchrun_line(log)
        if rc == 0:
            recs = runs.step_records(rd)
            row["measured"] = runs.steady(recs, WARMUP_STEPS)
            row["losses"] = [r["loss"] for r in recs]
            row["construction"] = construction(rd)
        else:
            row["error"] = log.read_text()[-3000:]
        result["scaling"].append(row)
        save()
        print(json.dumps({k: row.get(k) for k in ("gpus", "exit", "measured")}), flush=True)

        if g > 1 and a.profile_steps:
            prof = render(
                f"profile-{g}gpu",
                g,
                sets_for(
                    g,
                    cfg,
                    WARMUP_STEPS + a.profile_steps + 1,
                    [*no_ckpt, f"training.profile_steps={a.profile_steps}"],
                ),
                work,
            )
            plog = work / f"profile-{g}gpu.log"
            prc = run_to_end(prof, plog)
            pfile = output_dir(prof) / "profile.json"
            row["profile"] = json.loads(pfile.read_text()) if prc == 0 and pfile.is_file() else {"exit": prc}
            save()

    if a.no_preempt:
        return 0
    g = counts[-1]
    cfg = write_config(work, a.layers, EXPERTS_PER_GPU_AT_EP8 * g)
    rd = render(
        f"preempt-{g}gpu",
        g,
        sets_for(g, cfg, a.steps, ["checkpoint.every=100000", "checkpoint.final=false"]),
        work,
    )
    log = work / f"preempt-{g}gpu.log"
    pre = preempt(rd, log, a.preempt_at, timeout_s=1800)
    resumed, straight = losses(rd), dict(enumerate(result["scaling"][-1].get("losses", []), start=1))
    common = sorted(set(resumed) & set(straight))
    after = [s for s in common if s > pre["checkpointed_step"]]
    pre["losses"] = [resumed[s] for s in sorted(resumed)]
    pre["max_rel_diff_to_uninterrupted"] = {
        "before_stop": max(
            (abs(resumed[s] - straight[s]) / straight[s] for s in common if s <= pre["checkpointed_step"]),
            default=None,
        ),
        "after_resume": max((abs(resumed[s] - straight[s]) / straight[s] for s in after), default=None),
    }
    result["preemption"] = pre
    save()
    print(json.dumps({k: v for k, v in pre.items() if k != "losses"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
