"""LoRA on an FP8 base beside the same LoRA on a bf16 base, through the real trainer.

Writes a DeepSeek-V2-Lite-shaped model (random weights, `--layers` deep) in DeepSeek-V3's FP8 block
format (e4m3, 128 x 128 float32 `weight_scale_inv`, quantised by DeepSeek's rule: dskit/train/fp8/blocks.py),
then trains LoRA on it twice from that one checkpoint: `finetune.base_precision=fp8` (the base kept in
FP8, built from the meta device) and `bf16` (the same bytes dequantised while loading). Both compute
with bit-identical bf16 weights, so their loss curves should lie on each other; what differs is memory
and time. Each run's tokens/s and peak memory are printed against the plan's, with the construction
record (`frozen_bytes` by dtype) and the final checkpoint's size. `--full-too` adds a full fine-tune
of the same model (bf16, its checkpoint's size beside the LoRA one's: the issue's <= 5% goal).

    python bench/fp8_lora_bench.py --layers 27 --steps 30 --out bench/results/lora/RESULT.json --work /tmp/fl
    python bench/fp8_lora_bench.py --rows bench/results/lora/h200-fp8-lora*.json --predict   # JSON, for the tests
    python bench/fp8_lora_bench.py --model tiny-v2 --gpu cpu --steps 4 --out /tmp/fl.json   # a CPU dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import runs  # noqa: E402

SHARD_BYTES = 4 * 2**30
WARMUP_STEPS = 3


def write_fp8_checkpoint(model: str, layers: int, out: Path, device: str) -> dict:
    """A random `model`-shaped checkpoint, `layers` deep, in the FP8 format DeepSeek ships V3 in, laid out
    as `dskit export --fp8` writes it (dskit/train/export_fp8.py): every projection and routed expert e4m3
    + block scales, per-expert tensors as published; the embedding, norms, router and lm_head bf16."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from dskit import catalog
    from dskit.train import export_fp8
    from dskit.train.model import hf_config

    cfg = {**catalog.model(model).config, "num_hidden_layers": layers}
    torch.manual_seed(0)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(hf_config(cfg, "sdpa"), dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    state = m.state_dict()
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    written, sources = export_fp8.layout(shapes)
    tensor_of = export_fp8.tensors(shapes, sources, lambda name, shape, dtype: state[name].to(dtype))
    shards: list[dict] = [{}]
    size = 0
    for name, (shape, dtype) in written.items():
        if size > SHARD_BYTES:
            shards.append({})
            size = 0
        t = tensor_of(name, shape, dtype)
        shards[-1][name] = t.to("cpu")
        size += t.numel() * t.element_size()
    state.clear()
    del m, tensor_of
    gc.collect()
    torch.cuda.empty_cache()  # the runs that follow need the whole GPU: this process keeps none of it
    weight_map: dict[str, str] = {}
    for i, part in enumerate(shards):
        f = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, out / f, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, f))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(
        json.dumps({**cfg, "torch_dtype": "bfloat16", "quantization_config": export_fp8.QUANTIZATION_CONFIG})
    )
    return {"path": str(out), "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}


def run_one(label: str, ckpt: Path, sets: list[str], gpu: str, steps: int, work: Path) -> dict:
    from dskit.plan.schema import load_plan
    from dskit.render.run_dir import render_run
    from dskit.spec import load_spec

    common = [
        f"training.steps={steps}",
        "training.log_every=1",
        f"checkpoint.every={steps}",
        "checkpoint.final=true",
        "checkpoint.keep=1",
    ]
    flags = {
        "hardware.gpu": gpu,
        "hardware.gpus_per_node": 1 if gpu != "cpu" else 2,
        "model.path": str(ckpt),
        "runtime.kind": "none",
        "storage.root": str(work / "storage"),
        "name": label,
    }
    run = render_run(load_spec(sets=[*common, *sets], flags=flags), "slurm", work / label)
    plan = run.plan
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "dskit", "train", "--local", str(run.out)],
        capture_output=True, text=True, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    row = {
        "label": label,
        "sets": sets,
        "plan": plan.summary(),
        "parallel": {  # the candidate that ran: what a later planner re-predicts (repredict)
            "zero_stage": plan.deepspeed["zero_optimization"]["stage"],
            "ep_size": plan.parallel.ep_size,
            "micro_batch": plan.parallel.micro_batch,
            "activation_checkpointing": plan.parallel.activation_checkpointing,
        },
        "predicted": {"memory_gib": plan.memory["total_gib"], **(plan.speed or {})},
        "construction_predicted_gib": plan.memory["construction_gib"],
        "wall_s": round(time.time() - t0, 1),
    }
    if proc.returncode != 0:
        row["error"] = (proc.stdout + proc.stderr)[-3000:]
        return row
    otherwise = runs.ran_otherwise(run.out)
    if otherwise:  # a fallback is not a measurement of the plan: no measured figures
        row["error"] = f"{otherwise}; not recorded"
        return row
    recs = runs.step_records(run.out)
    out_dir = Path(load_plan(run.out / "run.yaml").run.output_dir)
    ckpt_dir = Path(load_plan(run.out / "run.yaml").run.checkpoint_dir)
    tags = sorted(ckpt_dir.glob("step*"))
    row["measured"] = {
        **runs.steady(recs, min(WARMUP_STEPS, len(recs) - 1)),
        "losses": [round(r["loss"], 5) for r in recs],
        "step_s_all": [round(r["step_time_s"], 4) for r in recs],
        "construction": json.loads((out_dir / "construction-rank0.json").read_text()),
        "checkpoint_bytes": sum(p.stat().st_size for p in tags[-1].rglob("*") if p.is_file())
        if tags
        else None,
    }
    return row


def config_dir(model: str, layers: int, root: Path) -> Path:
    """A model directory holding only the config.json write_fp8_checkpoint writes (FP8 format): what the
    planner reads of a checkpoint, so a measured row is re-planned without its 15 GB of weights."""
    from dskit import catalog
    from dskit.train.export_fp8 import QUANTIZATION_CONFIG

    out = root / f"{model}-L{layers}-fp8"
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        **catalog.model(model).config,
        "num_hidden_layers": layers,
        "quantization_config": QUANTIZATION_CONFIG,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def load_rows(files: list[Path]) -> list[dict]:
    """Every measured row of these result files, each with its file's model, layers and GPU."""
    rows = []
    for f in files:
        d = json.loads(f.read_text())
        for r in d["rows"]:
            if "measured" in r:
                rows.append(
                    {
                        **r,
                        "model": d["model"],
                        "layers": d["layers"],
                        "file": f.name,
                        "_date": d.get("date", ""),
                    }
                )
    return rows


def _ran(row: dict) -> dict:
    """The candidate a row ran: recorded, or (rows written before it was) read from its plan summary."""
    if "parallel" in row:
        return row["parallel"]
    summary = row["plan"]
    if "activation checkpointing" in summary:
        raise ValueError(f"{row['label']}: the checkpointing interval is not in its summary")
    num = {k: int(re.search(p, summary).group(1)) for k, p in (
        ("zero_stage", r"ZeRO-(\d)"), ("ep_size", r"EP (\d+)"), ("micro_batch", r"micro-batch (\d+)"),
    )}  # fmt: skip
    return {**num, "activation_checkpointing": 0}


def repredict(row: dict, root: Path, gpu: str = "h200-141gb") -> dict:
    """Today's plan for a measured row, its candidate pinned: memory GiB and tokens/s/GPU."""
    from dskit.plan.build import build_plan
    from dskit.spec import load_spec

    ran = _ran(row)
    pinned = [f"overrides.{k}={v}" for k, v in ran.items() if f"overrides.{k}=" not in " ".join(row["sets"])]
    flags = {
        "hardware.gpu": gpu,
        "hardware.gpus_per_node": 1,
        "model.path": str(config_dir(row["model"], row["layers"], root)),
        "runtime.kind": "none",
    }
    with runs.as_measured(row["_date"]):
        plan = build_plan(load_spec(sets=[*row["sets"], *pinned], flags=flags))
    build = plan.memory["construction"]
    return {
        "memory_gib": plan.memory["total_gib"],
        "tokens_per_s_per_gpu": plan.speed["tokens_per_s_per_gpu"],
        # what construction-rankN.json's peak_alloc_gib measures: the allocator, not the CUDA context
        "construction_alloc_gib": plan.memory["construction_gib"] - build["overhead_gib"],
    }


def derived(files: list[Path], predict: bool) -> list[dict]:
    """`--rows`: the measured rows of these files as the calibration tests read them (`load_rows`'s,
    with `_source` and `_index`); `predict`: each with `_predicted` (`repredict`), or `_error` where
    today's plan cannot be rebuilt for it."""
    out = []
    with tempfile.TemporaryDirectory() as root:
        for f in files:
            for i, r in enumerate(load_rows([f])):
                d = {**r, "_source": str(f.resolve().relative_to(runs.RESULTS)), "_index": i}
                if predict:
                    try:
                        d["_predicted"] = repredict(r, Path(root))
                    except Exception as e:  # the test that reads it fails with this
                        d["_error"] = repr(e)
                out.append(d)
    return out


def variant(text: str) -> tuple[str, str, list[str]]:
    """--variant LABEL:BASE:SET,SET, checked before anything is written or run."""
    label, base, sets = (text.split(":", 2) + ["", ""])[:3]
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", label) or base not in ("fp8", "bf16") or "=" not in sets:
        raise argparse.ArgumentTypeError(
            f"{text!r}: want LABEL:BASE:KEY=VALUE[,KEY=VALUE] (LABEL lowercase letters, digits, '-'; BASE fp8 or bf16)"
        )
    return label, base, sets.split(",")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v2-lite", help="catalog preset whose shape is written")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--gpu", default="h200-141gb", help="hardware.gpu of the runs (cpu: a dry run)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--targets", default="[attention, shared_experts]", help="finetune.lora.targets")
    ap.add_argument("--only", action="append", help="run only these labels (fp8, bf16, fp8-mbN, full)")
    ap.add_argument("--full-too", action="store_true", help="also a full fine-tune (checkpoint size)")
    ap.add_argument(
        "--fp8-micro-batch",
        type=int,
        help="also the fp8 base at this micro-batch (the bf16 pick's: the time the dequantisation costs)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        type=variant,
        default=[],
        metavar="LABEL:BASE:SET,SET",
        help="also a LoRA run on base fp8|bf16 with these overrides, e.g. bf16-ckpt1:bf16:overrides.activation_checkpointing=1",
    )
    ap.add_argument("--checkpoint", type=Path, help="reuse an FP8 checkpoint written by an earlier call")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8-lora-bench"))
    runs.add_rows_args(ap, "with --rows: today's prediction of each")
    a = ap.parse_args()
    if a.rows:
        json.dump(derived(a.rows, a.predict), sys.stdout)
        return
    if not a.out:
        ap.error("--out is needed to measure")
    a.work.mkdir(parents=True, exist_ok=True)
    result = {**runs.header(), "model": a.model, "layers": a.layers, "rows": []}
    t0 = time.time()
    if a.checkpoint:
        ckpt = {
            "path": str(a.checkpoint),
            "bytes": sum(p.stat().st_size for p in a.checkpoint.glob("*.safetensors")),
        }
    else:
        ckpt = write_fp8_checkpoint(a.model, a.layers, a.work / "ckpt", "cpu" if a.gpu == "cpu" else "cuda")
    result["checkpoint"] = {**ckpt, "write_s": round(time.time() - t0, 1)}
    print(
        f"FP8 checkpoint {ckpt['path']}: {ckpt['bytes'] / 2**30:.2f} GiB in {time.time() - t0:.0f} s",
        flush=True,
    )
    shape = [f"training.seq_len={a.seq_len}", f"training.global_batch={a.global_batch}"]
    lora = ["finetune.method=lora", f"finetune.lora.targets={a.targets}", *shape]
    jobs = [
        ("fp8", [*lora, "finetune.base_precision=fp8"]),
        ("bf16", [*lora, "finetune.base_precision=bf16"]),
    ]
    if a.fp8_micro_batch:
        jobs.append(
            (f"fp8-mb{a.fp8_micro_batch}", [*jobs[0][1], f"overrides.micro_batch={a.fp8_micro_batch}"])
        )
    for label, base, sets in a.variant:
        jobs.append((label, [*lora, f"finetune.base_precision={base}", *sets]))
    if a.full_too:
        jobs.append(("full", shape))
    for label, sets in jobs:
        if a.only and label not in a.only:
            continue
        row = run_one(label, Path(ckpt["path"]), sets, a.gpu, a.steps, a.work)
        result["rows"].append(row)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(_line(row), flush=True)
    _compare(result["rows"])
    a.out.write_text(json.dumps(result, indent=1) + "\n")


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['label']:>7}: FAILED\n{r['error'][-1500:]}"
    m, p = r["measured"], r["predicted"]
    ck = m["checkpoint_bytes"]
    return (
        f"{r['label']:>7}: {m['tokens_per_s_per_gpu']:>7,} tok/s (plan {p.get('tokens_per_s_per_gpu', 0):>7,}), "
        f"peak reserved {m['peak_reserved_gib']:.1f} GiB (plan {p['memory_gib']:.1f}), build peak "
        f"{m['construction']['build_peak_alloc_gib']:.1f} (plan {r['construction_predicted_gib']:.1f}), "
        f"frozen {m['construction']['frozen_bytes']}, checkpoint {ck / 2**20 if ck else 0:.1f} MiB, "
        f"loss {m['loss_first']:.4f} -> {m['loss_last']:.4f}  [{r['plan']}]"
    )


def _compare(rows: list[dict]) -> None:
    by = {r["label"]: r for r in rows if "measured" in r}
    if "fp8" in by and "bf16" in by:
        a, b = by["fp8"]["measured"]["losses"], by["bf16"]["measured"]["losses"]
        rel = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=False))
        print(
            f"loss curves fp8 vs bf16 base: max relative difference {rel:.2e} over {min(len(a), len(b))} steps"
        )
    if "full" in by and "bf16" in by and by["full"]["measured"]["checkpoint_bytes"]:
        ratio = by["bf16"]["measured"]["checkpoint_bytes"] / by["full"]["measured"]["checkpoint_bytes"]
        print(f"checkpoint: LoRA {ratio:.4%} of the full run's")


if __name__ == "__main__":
    main()
