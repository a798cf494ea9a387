"""The routing bias in every checkpoint, in dskit's own file: `dskit-routing-bias.safetensors`.

DeepSeek-V3's per-expert routing bias (`e_score_correction_bias`) is a buffer of AutoEP's router, moved
by the trainer under `training.balance: aux_free` (dskit/train/balance.py). Two of the ways a run is
saved and resumed leave buffers out:
- DeepSpeed's universal checkpoint (a resume at another world or EP size, reshard.py) restores the
  parameters from `zero/<name>/` and skips the module state, buffers included (deepspeed 0.19.8,
  engine.py `_load_checkpoint`: `if not self.load_universal_checkpoint(): self.load_module_state_dict`):
  the bias would restart from model.path's;
- a LoRA run's checkpoint holds its trained tensors only (dskit/train/lora/adapter_state.py).
So rank 0 writes every router's bias, fp32, by its module name, into each tag; it lands with the tag's
other files (written under tmp-<tag>, renamed whole, size and CRC-32 in rank 0's manifest), and every
resume copies it back, whatever loaded the rest. Before writing and after reading, every rank's bias is
compared with rank 0's, bit for bit: the update keeps them identical, so a difference is a bug, and
the checkpoint must not hide it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("dskit.train")

FILE = "dskit-routing-bias.safetensors"
SUFFIX = "e_score_correction_bias"


def hf_name(autoep_name: str) -> str:
    """The transformers name of a router's bias saved here (AutoEP's `mlp.router` is transformers'
    `mlp.gate`: dskit/train/export.py HF_FROM_AUTOEP)."""
    return re.sub(
        r"(\.mlp)\.router\.e_score_correction_bias$", r"\1.gate.e_score_correction_bias", autoep_name
    )


@torch.no_grad()
def rank_max_diff_tensor(biases: dict[str, torch.Tensor]) -> torch.Tensor:
    """Collective: the largest difference between any rank's bias and rank 0's (0.0: identical), as a
    one-element tensor on the biases' device (read it when it is needed: reading syncs a GPU)."""
    stacked = torch.cat([b.detach().float().reshape(-1) for b in biases.values()])
    first = stacked.clone()
    dist.broadcast(first, src=0)
    diff = (stacked - first).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff


def rank_max_diff(biases: dict[str, torch.Tensor]) -> float:
    """`rank_max_diff_tensor`, read."""
    return rank_max_diff_tensor(biases).item()


def _check_identical(biases: dict[str, torch.Tensor], when: str) -> None:
    diff = rank_max_diff(biases)
    if diff != 0.0:
        raise RuntimeError(f"the routing bias differs between ranks {when} (by up to {diff:g})")


def save(tag_dir: Path, biases: dict[str, torch.Tensor], *, rank: int) -> None:
    """Collective: check every rank holds the same bias, then rank 0 writes it into `tag_dir`."""
    from safetensors.torch import save_file

    _check_identical(biases, "at a checkpoint")
    if rank == 0:
        tensors = {n: b.detach().float().cpu().contiguous() for n, b in biases.items()}
        save_file(tensors, str(tag_dir / FILE), metadata={"format": "pt"})


def read(tag_dir: Path) -> dict[str, torch.Tensor] | None:
    """The bias a checkpoint carries, by AutoEP module name: its routing-bias file, else (a full run's
    checkpoint written before the file existed) the module state DeepSpeed saved; None when neither
    holds one (a model without the bias)."""
    f = tag_dir / FILE
    if f.is_file():
        from safetensors.torch import load_file

        return load_file(str(f))
    for states in sorted(tag_dir.glob("*model_states.pt")):  # memory-mapped: ZeRO-1/2's hold the model
        module = torch.load(states, weights_only=False, map_location="cpu", mmap=True).get("module") or {}
        found = {k: v.float().clone() for k, v in module.items() if k.endswith(SUFFIX)}
        if found:
            return found
    return None


@torch.no_grad()
def restore(tag_dir: Path, biases: dict[str, torch.Tensor]) -> None:
    """Collective: copy the checkpoint's bias into the routers' (every rank reads the same file), then
    check every rank holds the same."""
    saved = read(tag_dir)
    if saved is None:
        log.warning(
            "checkpoint %s holds no routing bias (a LoRA run's written before dskit saved it): the "
            "routers keep model.path's",
            tag_dir,
        )
    else:
        if saved.keys() != biases.keys():
            missing, extra = sorted(biases.keys() - saved.keys()), sorted(saved.keys() - biases.keys())
            raise RuntimeError(
                f"{tag_dir / FILE} holds the routing biases of other routers (missing {missing[:3]}, "
                f"unexpected {extra[:3]})"
            )
        for name, b in biases.items():
            if saved[name].shape != b.shape:
                got, want = tuple(saved[name].shape), tuple(b.shape)
                raise RuntimeError(f"{tag_dir / FILE}: {name} is {got}, the router's {want}")
            b.copy_(saved[name].to(b.device, b.dtype))
    _check_identical(biases, "after loading the checkpoint")
