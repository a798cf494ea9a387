"""Start training from a local Hugging Face checkpoint (under ZeRO-3 without any rank holding the whole model).

The checkpoint is checked first, from the safetensors headers alone and identically on every rank, so
a missing, truncated or foreign shard is one line and exit 2 everywhere instead of a hang. Then
under ZeRO-3, transformers' loader fills the partitioned model module by module: rank 0 reads each tensor
(memory-mapped, so host memory holds pages of the shard being read, not the model), converts
published per-expert weights to transformers' fused layout one layer at a time, and DeepSpeed
scatters every module to the ranks that own its slices. Under ZeRO-1/2 every rank loads the whole
model onto its GPU (memory-mapped shards), as the plan's construction estimate counts. Whatever fails
on one rank fails on all.
"""

from __future__ import annotations

from dskit.errors import SpecError
from dskit.hf_checkpoint import check_checkpoint

# Buffers transformers recomputes or that no published checkpoint carries: their absence is fine.
UNSAVED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


def load_pretrained(path: str, *, config, dtype, device=None):
    """The checkpoint at `path` loaded into a ZeRO-3-partitioned model (transformers' DeepSpeed
    integration must be active: see model.build_model), or with `device` (ZeRO-1/2) whole onto it."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    check_checkpoint(path)
    model, problem = None, None
    try:
        placed = {} if device is None else {"device_map": {"": str(device)}}
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=dtype, local_files_only=True, output_loading_info=True, **placed
        )
        missing = sorted(k for k in info["missing_keys"] if not k.endswith(UNSAVED_SUFFIXES))
        if info.get("error_msgs"):
            problem = f"{path} does not match the model: {_first_line(info['error_msgs'][0])}"
        elif missing:
            problem = f"{path} lacks {len(missing)} of the model's tensors, e.g. {missing[0]}"
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        problem = f"cannot load weights from {path}: {_first_line(str(e))}"
    # Under ZeRO-3 only rank 0 reads values, so only rank 0 sees most problems: agree before anyone goes on.
    flag = torch.tensor([0 if problem else 1], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        raise SpecError("model.path", problem or f"rank 0 could not load {path} (its log says why)")
    return model


def _first_line(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return " ".join(lines[:2])[:400] if lines else "unknown error"
