"""Which LoRA targets train best per trainable byte, on CPU with a tiny model.

A tiny DeepSeek model (`--model`, widened so its projections are not smaller than r) is pre-trained
for `--pretrain-steps` on the embedded corpus, saved, and fine-tuned from that checkpoint with LoRA
through the real trainer (2 gloo ranks, AutoEP EP 2) once per target set, same r, batches and steps.
Each batch is a fresh draw from the corpus, so the training loss of the last steps is an estimate of
held-out loss. For each set: trainable parameters (the plan's count, what a checkpoint holds), the
loss drop from the base (step 1, before any update) to the mean of the last 5 steps, and the drop per
million trainable parameters. Prints a table and writes JSON.

    python bench/lora_targets_bench.py --out bench/results/RESULT.json

A tiny model on CPU is not DeepSeek-V2-Lite: the per-byte ranking is evidence for the default, not a
measurement of it at scale (that needs a pretrained checkpoint, which no machine here holds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import runs  # noqa: E402  (bench/runs.py, beside this script)

TARGET_SETS = [
    "[attention]",
    "[shared_experts]",
    "[attention, shared_experts]",
    "[routed_experts]",
    "[attention, shared_experts, routed_experts]",
    "[attention, shared_experts, dense_mlp, router]",
]
#: wider than the catalog's tiny models, so that r 16 is a low rank of every projection
WIDE = {"hidden_size": 160, "moe_intermediate_size": 144, "intermediate_size": 272, "q_lora_rank": 136}


def pretrain(model: str, out: Path, steps: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from dskit import catalog
    from dskit.data.sampler import Sampler
    from dskit.data.shards import TokenData
    from dskit.train.model import hf_config

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(hf_config({**catalog.model(model).config, **WIDE}, "sdpa"))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sampler = Sampler(TokenData.open(None), 128, seed=1)
    for step in range(steps):
        batch = torch.from_numpy(sampler.batch(10_000 + 8 * step, 8))
        m(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss.backward()
        opt.step()
        opt.zero_grad()
    m.to(torch.bfloat16).save_pretrained(out)
    return out


def finetune(base: Path, targets: str, r: int, steps: int, work: Path) -> dict:
    from dskit.plan.schema import load_plan
    from dskit.render.run_dir import render_run
    from dskit.spec import load_spec

    name = "t-" + "".join(c if c.isalnum() else "-" for c in targets).strip("-")
    sets = [
        "training.seq_len=128",
        "training.global_batch=8",
        "training.lr=1e-3",
        "training.log_every=1",
        f"training.steps={steps}",
        "checkpoint.every=100000",
        "checkpoint.final=false",
        "finetune.method=lora",
        f"finetune.lora.r={r}",
        f"finetune.lora.targets={targets}",
        f"model.path={base}",
    ]
    flags = {
        "hardware.gpu": "cpu",
        "hardware.gpus_per_node": 2,
        "runtime.kind": "none",
        "runtime.python": sys.executable,
        "storage.root": str(work / "storage"),
        "name": name,
    }
    run = render_run(load_spec(sets=sets, flags=flags), "slurm", work / name)
    proc = subprocess.run(
        [sys.executable, "-m", "dskit", "train", "--local", str(run.out)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if proc.returncode != 0:
        return {"targets": targets, "error": (proc.stdout + proc.stderr)[-2000:]}
    losses = [rec["loss"] for rec in runs.step_records(run.out)]
    trainable = load_plan(run.out / "run.yaml").finetune.trainable_params
    drop = losses[0] - statistics.mean(losses[-5:])
    return {
        "targets": targets,
        "trainable_params": trainable,
        "losses": [round(x, 5) for x in losses],
        "loss_drop": round(drop, 5),
        "drop_per_m_params": round(drop / (trainable / 1e6), 5),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-v3")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--pretrain-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    result = {**runs.header(), "model": a.model, "widened": WIDE, "r": a.r, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = pretrain(a.model, work / "base", a.pretrain_steps)
        for targets in TARGET_SETS:
            row = finetune(base, targets, a.r, a.steps, work)
            result["rows"].append(row)
            a.out.write_text(json.dumps(result, indent=1) + "\n")
            if "error" in row:
                print(f"{targets}: FAILED\n{row['error']}", flush=True)
            else:
                print(
                    f"{targets:48} trainable {row['trainable_params']:>9,}  loss {row['losses'][0]:.4f} -> "
                    f"{statistics.mean(row['losses'][-5:]):.4f}  drop {row['loss_drop']:.4f}  "
                    f"per M params {row['drop_per_m_params']:.4f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
