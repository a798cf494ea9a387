"""A LoRA run's checkpoint files: what trains, and nothing of the frozen base.

DeepSpeed's `save_checkpoint` cannot write these runs: under ZeRO-3 + AutoEP it raises for frozen
routed experts (engine.py `_save_moe_checkpoint`: "does not support frozen expert parameters yet"),
and under ZeRO-1/2 its per-expert loop writes every expert weight whatever its requires_grad, i.e. the
whole frozen base at every save. So each tag holds, beside dskit's own files (checkpoint.py):

    adapter.safetensors   rank 0: every trainable parameter, gathered whole, by transformers name; the
                          routed experts' adapters stacked by global expert index over the EP group
                          (`model.layers.N.mlp.experts.w1.lora_A` [E, r, h]: dskit/train/lora/routed.py)
                          (`dskit export --adapter-only` and the merged export read it)
    zero-rank{R}.pt       each rank: its ZeRO optimizer partition (fp32 master weights, Adam moments),
                          as DeepSpeed's own files hold it (`engine.optimizer.state_dict()`)

The optimizer partitions follow the EP layout, so a resume needs the EP size the checkpoint was written
with (checkpoint.py refuses another in one line, overrides.ep_size). The frozen base is rebuilt at every start from what built it first (model.path, or the seeded
random init: dskit/train/model.py), so a resume reproduces the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import torch

ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "zero-rank{rank}.pt"


def _zero3(engine) -> bool:
    return engine.zero_optimization_stage() == 3


def gathered(engine) -> dict[str, torch.Tensor]:
    """Every trainable parameter whole, on every rank (collective under ZeRO-3: each holds a shard; and
    over the EP groups when the routed experts are adapted: each rank holds its experts' adapters,
    which are stacked by global expert index, so the file does not depend on the EP size)."""
    import deepspeed

    from dskit.train.lora.inject import trainable
    from dskit.train.lora.routed import gather_experts, is_routed

    params = trainable(engine.module)

    def whole() -> dict[str, torch.Tensor]:
        out = {n: p.detach().clone() for n, p in params.items()}
        out.update(gather_experts(engine, {n: t for n, t in out.items() if is_routed(n)}))
        return {n: t.cpu() for n, t in out.items()}

    if not _zero3(engine):
        return whole()
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return whole()


class AdapterStates:
    """`Checkpointer`'s writer and reader for LoRA runs (the other is DeepSpeedStates)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def save(self, engine, root: Path, tag: str) -> None:
        from safetensors.torch import save_file

        d = root / tag
        tensors = gathered(engine)
        if self.rank == 0:
            save_file({n: t.contiguous() for n, t in tensors.items()}, str(d / ADAPTER_FILE))
        state = {
            "optimizer": engine.optimizer.state_dict(),
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
        }
        torch.save(state, d / OPTIMIZER_FILE.format(rank=self.rank))

    def load(self, engine, root: Path, tag: str) -> None:
        from safetensors.torch import load_file

        from dskit.train.lora.inject import trainable
        from dskit.train.lora.routed import is_routed, local_part

        d = root / tag
        state = torch.load(d / OPTIMIZER_FILE.format(rank=self.rank), weights_only=False, map_location="cpu")
        if not _zero3(engine):
            # ZeRO-1/2 keep the 16-bit weights apart from the fp32 master: both are restored. ZeRO-3's
            # optimizer rewrites its 16-bit partitions from the fp32 ones as it loads (stage3.py
            # `_rigid_load_state_dict`).
            saved = load_file(str(d / ADAPTER_FILE))
            with torch.no_grad():
                for name, p in trainable(engine.module).items():
                    t = local_part(engine, name, saved[name]) if is_routed(name) else saved[name]
                    p.copy_(t.to(p.device, p.dtype))
        # indexed by the data-parallel rank, every one of which is this rank's own file here
        engine.optimizer.load_state_dict(
            [state["optimizer"]] * self.world, load_optimizer_states=True, load_from_fp32_weights=True
        )
        engine.global_steps = state["global_steps"]
        engine.global_samples = state["global_samples"]
        engine.skipped_steps = state["skipped_steps"]
