"""Build an FP8 frozen base (`finetune.base_precision: fp8`, ZeRO-1/2) without a bf16 copy of it anywhere.

The model is created on the meta device (shapes only), then filled from model.path tensor by tensor
onto this rank's GPU:
- every nn.Linear the checkpoint holds in FP8 becomes an `Fp8Linear` of the checkpoint's own e4m3
  bytes and scales (dskit/train/fp8/loading.py `swap_in_fp8_linears`);
- every other tensor (embeddings, norms, the router, lm_head) is read in the dtype the model declares
  (what transformers' loader gives: the router's gate and score bias stay float32), an FP8 one
  dequantised as it is read;
- the routed experts stay on the meta device: AutoEP replaces each MoE block inside
  `deepspeed.initialize`, and `fp8_base.experts_stay_fp8` then reads this rank's experts, in FP8, from
  the checkpoint.

So a rank holds, from the first tensor on, what it trains with: the non-expert base in FP8 (bf16 where
the checkpoint is) and 1/ep of the routed experts in FP8. DeepSeek-V3 on one 8 x H200 node is ~94 GiB of
FP8 per GPU; built whole in bf16 first (as ZeRO-1/2 build a bf16 model) it was 1,250 GiB per GPU.

Non-persistent buffers (the rotary embedding's inverse frequencies) are not in a checkpoint: the
rotary module is rebuilt on the device from the config, as transformers' own init computes it.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from dskit.errors import SpecError

log = logging.getLogger("dskit.train")

#: transformers' fused routed experts (DeepseekV2/V3Experts): filled per rank by AutoEP + experts_stay_fp8
FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def build_fp8_base(path: str, *, config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model of `config` with the FP8 checkpoint at `path` as its frozen base, on `device`, routed
    experts left on the meta device for AutoEP. A checkpoint that does not fill the model is SpecError
    on every rank (each rank reads the same tensors, so each sees the same problem)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from dskit.formats.hf_checkpoint import check_checkpoint
    from dskit.train.fp8.frozen_base import checkpoint_format
    from dskit.train.fp8.loading import swap_in_fp8_linears

    check_checkpoint(path)
    fmt = checkpoint_format(path)
    with torch.device("meta"):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._from_config(config, dtype=dtype)
    swapped = swap_in_fp8_linears(model, path, device=device)
    loaded = _load_the_rest(model, path, fmt, device)
    _rebuild_rotary(model, device)
    stray = [
        n
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_meta and not FUSED_EXPERTS.search(n)
    ]
    if stray:  # a tensor neither the checkpoint nor the config fills: refuse rather than train on garbage
        raise RuntimeError(f"fp8 base: {len(stray)} tensors left unfilled, e.g. {stray[0]}")
    log.info(
        "fp8 base built on %s from %s: %d linear layers in FP8, %d other tensors read; routed experts "
        "left for AutoEP (this rank's are read in FP8 when it replaces each MoE block)",
        device, path, len(swapped), loaded,
    )  # fmt: skip
    return model


def _load_the_rest(model: nn.Module, path: str, fmt: Any, device: torch.device) -> int:
    """Fill every meta parameter and persistent buffer but the fused routed experts from the checkpoint,
    in the dtype the model declares for it. Returns how many were read."""
    from dskit.train.fp8.blocks import dequantize_blocks
    from dskit.train.fp8.loading import open_shards

    # tied tensors (an lm_head sharing the embedding) appear under every name: read one, tie the rest
    aliases: dict[int, list[str]] = {}
    for n, t in model.state_dict(keep_vars=True).items():
        if t.is_meta and not FUSED_EXPERTS.search(n):
            aliases.setdefault(id(t), []).append(n)
    metas = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    read = []
    with open_shards(path) as shards:
        absent = [names[0] for names in aliases.values() if not any(n in shards for n in names)]
        if absent:
            raise SpecError(
                "model.path", f"{path} lacks {len(absent)} of the model's tensors, e.g. {absent[0]}"
            )
        for key, names in aliases.items():
            name, meta = next(n for n in names if n in shards), metas[key]
            value = shards[name].get_tensor(name).to(device)
            if name in fmt.weights:
                scale = fmt.scale_of(name)
                value = dequantize_blocks(
                    value, shards[scale].get_tensor(scale).to(device), fmt.block, meta.dtype
                )
            if tuple(value.shape) != tuple(meta.shape):
                raise SpecError(
                    "model.path", f"{path}: {name} is {list(value.shape)}; the model's is {list(meta.shape)}"
                )
            _assign(model, name, value.to(meta.dtype), requires_grad=meta.requires_grad)
            read.append(name)
    if any(len(names) > 1 for names in aliases.values()):
        model.tie_weights()
    return len(read)


def _assign(model: nn.Module, name: str, value: torch.Tensor, *, requires_grad: bool) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=requires_grad)
    else:
        module._buffers[attr] = value


def _rebuild_rotary(model: nn.Module, device: torch.device) -> None:
    """Rotary modules hold only non-persistent buffers computed from the config: build them again on
    `device`, as a model built there computes them (transformers' DeepseekV2/V3RotaryEmbedding(config))."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding") and any(b.is_meta for b in module.buffers()):
            owner, _, attr = name.rpartition(".")
            with torch.device(device):
                setattr(model.get_submodule(owner), attr, type(module)(module.config))
