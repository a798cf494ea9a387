"""Can DeepSpeed 0.19.8's PipelineEngine train a DeepSeek MoE with AutoEP? On the CPU (gloo), tiny-v3.

The question behind bench/pipeline_what_if.py: AutoEP documents its folding with pipeline parallelism
as "planned separately" (`auto_ep_folding.py`), and the trainer has no pipeline path. This builds a
`PipelineModule` over the Hugging Face model's own modules (embedding, decoder layers, norm + head),
lets AutoEP replace the stage's MoE layers (its preset's pattern names `model.layers.N.mlp`; a stage's
modules are `N.layer.mlp`, so the pattern is given) under ZeRO-1, trains a few steps with
`train_batch`, and compares every step's loss with the plain model trained by torch on the same
batches in fp32. Prints a table and writes JSON.

    python bench/pipeline_probe.py --out bench/results/pipeline/cpu-pipeline-probe-2026-12-02.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SEQ, MICRO_BATCH, GRAD_ACCUM, LR, SEED = 32, 2, 4, 1e-3, 0
#: (pipeline stages, EP size, ranks)
LAYOUTS = ((2, 1, 2), (2, 2, 4))


def _model():
    import torch
    from transformers import AutoModelForCausalLM

    from dskit import catalog
    from dskit.train.model import hf_config

    config = hf_config(catalog.model("tiny-v3").config, "sdpa")  # the trainer's own config builder
    config.use_cache = False
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train(), config


def _batches(steps: int, dp: int):
    """The global batch of every micro-step: MICRO_BATCH sequences per data-parallel rank."""
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (steps, GRAD_ACCUM, MICRO_BATCH * dp, SEQ), generator=g)


def _loss(logits, ids):
    import torch

    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
    )


def reference(steps: int, dp: int) -> list[float]:
    """The plain model, one process, torch's AdamW and clipping as DeepSpeed's config below."""
    import torch

    model, _ = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in _batches(steps, dp):
        total = 0.0
        for ids in step:
            loss = _loss(model(input_ids=ids).logits, ids)
            (loss / GRAD_ACCUM).backward()
            total += loss.item() / GRAD_ACCUM
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def worker(pp: int, ep: int, steps: int, out: Path) -> None:
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    model, config = _model()
    rotary = model.model.rotary_emb

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = model.model.embed_tokens

        def forward(self, ids):
            return self.embed_tokens(ids)

    class Layer(torch.nn.Module):
        def __init__(self, i: int):
            super().__init__()
            self.layer = model.model.layers[i]

        def forward(self, h):
            pos = torch.arange(h.shape[1]).unsqueeze(0).expand(h.shape[0], -1)
            out = self.layer(h, attention_mask=None, position_ids=pos, position_embeddings=rotary(h, pos))
            return out[0] if isinstance(out, tuple) else out

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lm_head = model.model.norm, model.lm_head

        def forward(self, h):
            return self.lm_head(self.norm(h))

    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    layers = [Embed(), *(Layer(i) for i in range(config.num_hidden_layers)), Head()]
    module = PipelineModule(layers=layers, num_stages=pp, loss_fn=_loss, partition_method="uniform")
    module.config = config  # AutoEP reads top_k and the expert count from model.config
    ds = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "train_batch_size": MICRO_BATCH * GRAD_ACCUM * world // pp,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "expert_parallel": {
            "enabled": True,
            "autoep_size": ep,
            "preset_model": "deepseek_v3",
            "moe_layer_pattern": r"\d+\.layer\.mlp",
        },
        "steps_per_print": 10**9,
    }
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=ds)
    dp_rank, dp = engine.grid.get_data_parallel_id(), engine.grid.get_data_parallel_world_size()
    batches = _batches(steps, dp)

    def micro_steps():
        for step in batches:
            for ids in step:
                mine = ids[dp_rank * MICRO_BATCH : (dp_rank + 1) * MICRO_BATCH]
                yield mine, mine

    it = micro_steps()
    losses = [float(engine.train_batch(data_iter=it)) for _ in range(steps)]
    if engine.is_last_stage() and dp_rank == 0:
        out.write_text(json.dumps(losses))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument("--worker", nargs=3, type=str, help=argparse.SUPPRESS)  # pp ep out-file (torchrun)
    a = ap.parse_args()
    if a.steps < 1:
        ap.error(f"--steps: {a.steps}; at least 1")
    if a.worker:
        worker(int(a.worker[0]), int(a.worker[1]), a.steps, Path(a.worker[2]))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pp, ep, ranks in LAYOUTS:
            out = Path(tmp) / f"pp{pp}-ep{ep}.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={ranks}",
                f"--master-port={_free_port()}",
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
            run = subprocess.run(
                [*cmd, __file__, "--steps", str(a.steps), "--worker", str(pp), str(ep), str(out)],
                env=env,
                capture_output=True,
                text=True,
            )
            if run.returncode or not out.exists():
                sys.exit(f"pipeline_probe: PP {pp} x EP {ep} failed:\n{run.stderr[-3000:]}")
            got, want = json.loads(out.read_text()), reference(a.steps, ranks // pp)
            diff = max(abs(x - y) for x, y in zip(got, want, strict=True))
            rows.append(
                {"pp": pp, "ep": ep, "ranks": ranks, "losses": got, "reference": want, "max_abs_diff": diff}
            )
            print(
                f"PP {pp} x EP {ep} on {ranks} ranks (ZeRO-1, AutoEP, gloo): max |loss - plain| = {diff:.2e} over {a.steps} steps"
            )
    if a.out:
        import deepspeed
        import torch

        head = {
            "command": " ".join(["python", *sys.argv]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hardware": "CPU only (gloo)",
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
        }
        a.out.write_text(json.dumps({**head, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
