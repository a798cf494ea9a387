"""What the trainer's losses must equal, computed with plain transformers on the same batches."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from dskit.plan.schema import load_plan


def first_step_loss(model: torch.nn.Module, run_dir: Path, *, masked: bool = True) -> float:
    """Mean over ranks of each rank's step-1 cross-entropy, batched exactly as the trainer batches it
    (labels as the data gives them: masked for chat data). `masked=False`: on every next token of the
    row instead, prompts included (the contrast for chat data)."""
    from dskit.data import IGNORE_INDEX
    from dskit.data.sampler import Sampler, sample_index
    from dskit.data.shards import TokenData

    plan = load_plan(run_dir / "run.yaml")
    par, world = plan.parallel, plan.hardware.world_size
    model.eval()
    model.config.use_cache = False
    sampler = Sampler(
        TokenData.open(plan.run.data_path), par.seq_len, plan.run.seed, packing=plan.run.packing
    )
    total = 0.0
    with torch.no_grad():
        for rank in range(world):
            for micro in range(par.grad_accum):
                first = sample_index(
                    0, micro, rank, grad_accum=par.grad_accum, world=world, micro_batch=par.micro_batch
                )
                b = sampler.get(first, par.micro_batch)
                pos = None if b.position_ids is None else torch.from_numpy(b.position_ids)
                logits = model(input_ids=torch.from_numpy(b.input_ids), position_ids=pos).logits
                labels = torch.from_numpy(b.labels)
                if not masked:
                    logits, labels = logits[:, :-1], torch.from_numpy(b.input_ids[:, 1:])
                ce = F.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]),
                    labels.reshape(-1),
                    ignore_index=IGNORE_INDEX,
                )
                total += ce.item() / par.grad_accum
    return total / world
