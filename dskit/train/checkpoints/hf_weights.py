"""Start training from a local Hugging Face checkpoint (under ZeRO-3 without any rank holding the whole model).

The checkpoint is checked first, from the safetensors headers alone and identically on every rank, so
a missing, truncated or foreign shard is one line and exit 2 everywhere instead of a hang. Then
under ZeRO-3, transformers' loader fills the partitioned model module by module: rank 0 reads each tensor
(memory-mapped, so host memory holds pages of the shard being read, not the model), converts
published per-expert weights to transformers' fused layout one layer at a time, and DeepSpeed
scatters every module to the ranks that own its slices. Under ZeRO-1/2 every rank loads the whole
model onto its GPU (memory-mapped shards), as the plan's construction estimate counts. Whatever fails
on one rank fails on all.

A checkpoint in DeepSeek-V3's FP8 format (dskit/formats/hf_checkpoint.py `fp8_format`) loads the same way,
each weight dequantised to the training dtype as it is read (dskit/train/fp8/loading.py): no bf16
copy on disk, and in host memory at most one decoder layer's dequantised weights at a time.
"""

from __future__ import annotations

from contextlib import ExitStack

from dskit.errors import SpecError
from dskit.formats.hf_checkpoint import Fp8Format, check_checkpoint, fp8_format

# Buffers transformers recomputes or that no published checkpoint carries: their absence is fine.
UNSAVED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


def load_pretrained(path: str, *, config, dtype, device=None):
    """The checkpoint at `path` loaded into a ZeRO-3-partitioned model (transformers' DeepSpeed
    integration must be active: see model.build_model), or with `device` (ZeRO-1/2) whole onto it."""
    import torch
    import torch.distributed as dist
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    check_checkpoint(path)
    fmt = fp8_format(path)
    model, problem = None, None
    try:
        placed = {} if device is None else {"device_map": {"": str(device)}}
        with ExitStack() as stack:
            if fmt is None:
                source = {"pretrained_model_name_or_path": path, "local_files_only": True}
            else:
                source = {
                    "pretrained_model_name_or_path": None,
                    "state_dict": _fp8_source(stack, path, fmt, dtype, device),
                }
            # the model class itself: the Auto class needs a path to look for remote code in
            cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
            model, info = cls.from_pretrained(
                config=config, dtype=dtype, output_loading_info=True, **source, **placed
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


def _fp8_source(stack: ExitStack, path: str, fmt: Fp8Format, dtype, device) -> dict:
    """The FP8 checkpoint as a state dict that dequantises each weight as the loader reads it
    (dskit/train/fp8/loading.py); under ZeRO-3 (no `device`) transformers is fed one layer at a time."""
    import torch.distributed as dist

    from dskit.train.fp8.loading import fp8_state_dict, zero3_loads_layer_by_layer

    if device is not None:
        return stack.enter_context(fp8_state_dict(path, fmt, dtype=dtype, device=device, values="slice"))
    values = "tensor" if dist.get_rank() == 0 else "meta"
    sd = stack.enter_context(fp8_state_dict(path, fmt, dtype=dtype, values=values))
    stack.enter_context(zero3_loads_layer_by_layer())
    return sd


def _first_line(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return " ".join(lines[:2])[:400] if lines else "unknown error"
