"""Build the Hugging Face DeepSeek model the plan describes, with the attention backend resolved here.

Attention: MLA has q/k head dim 192 and v head dim 128 (V2/V3 config.json), which not every kernel
takes. The catalog's per-GPU default (`dskit/catalog/gpus.yaml` `attention`) is FlashAttention-4 on sm90
(dskit/train/attention.py: 192/128 natively, packed chat rows through its varlen kernel), FlashAttention-2
on sm80/86/89 (V padded to 192, the output cropped), plain SDPA elsewhere; docs/planner.md
"Attention on each GPU" has the measurements behind it.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from dskit.errors import SpecError
from dskit.host.flash_kernels import KERNELS
from dskit.refusals import fp8_base_zero_stage
from dskit.train.attention import kernels_missing

log = logging.getLogger("dskit.train")


def torch_dtype(precision: str) -> torch.dtype:
    """The dtype of a plan's precision: the trainer builds the model in it and export writes it."""
    return torch.bfloat16 if precision == "bf16" else torch.float16


def hf_config(cfg: dict[str, Any], attention: str):
    from transformers import AutoConfig

    c = dict(cfg)
    model_type = c.pop("model_type")
    config = AutoConfig.for_model(model_type, **c)
    if attention in KERNELS:
        from dskit.train.attention import register

        attention = register(attention)  # dskit's own: packed rows at any micro-batch (attention.py)
    config._attn_implementation = "sdpa" if attention == "sdpa_cudnn" else attention
    return config


def resolve_attention(planned: str, device: torch.device) -> tuple[str, str]:
    """(backend to use, reason). Falls back only where the planned kernel is missing, and says so."""
    if device.type != "cuda":
        if planned not in ("sdpa", "eager"):
            return "sdpa", f"planned {planned} needs a CUDA device; using sdpa on {device.type}"
        return planned, f"{planned} as planned"
    if planned in KERNELS:
        missing = kernels_missing(planned)
        if missing:
            return "sdpa_cudnn" if torch.cuda.get_device_capability(device)[0] >= 9 else "sdpa", (
                f"WARNING: planned {planned} but {missing} in this image; rebuild with "
                "`dskit render image` for this GPU"
            )
    return planned, f"{planned} as planned"


def apply_sdpa_policy(backend: str) -> None:
    """sdpa_cudnn: allow only cuDNN attention, so a shape it refuses fails loudly instead of silently
    running the 9x slower memory-efficient kernel."""
    if backend == "sdpa_cudnn":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(True)


def build_model(
    model_plan,
    *,
    attention: str,
    dtype: torch.dtype,
    seed: int,
    ckpt_every: int,
    deepspeed_config: dict[str, Any],
    loss_chunk_tokens: int = 0,
    device: torch.device | None = None,
    fp8_base: bool = False,
):
    """The model for the plan's ZeRO stage; random init or local weights, or (`fp8_base`, ZeRO-1/2)
    model.path's FP8 checkpoint as a frozen FP8 base built from the meta device (dskit/train/fp8/construct.py).

    ZeRO-3: under transformers' DeepSpeed integration (`HfDeepSpeedConfig` alive while the model is
    built), every parameter is created inside `deepspeed.zero.Init`: a rank keeps only its 1/world
    slice, and initialisation or loading gathers one module at a time (rank 0 fills it, the others
    receive it). No rank ever holds the whole model, so a plan that fits the cluster also starts on it.
    ZeRO-1 and 2 keep every 16-bit weight on every rank anyway: the model is built whole on `device`
    (the GPU: initialising there is fast, and draws from the same generator as ZeRO-3's zero.Init,
    which allocates on the GPU too) and `deepspeed.initialize` (AutoEP) keeps this rank's experts; the
    planner counts that construction peak (dskit/plan/memory.py). The returned model carries the integration
    object: transformers consults it until the engine owns the model.

    Random weights are drawn per module from a generator seeded by (seed, module name), so every ZeRO
    stage starts from the same weights: zero.Init consumes the global generator differently while it
    builds, which made stage 3's first loss differ from stage 1's and 2's.
    """
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    if not model_plan.trainable:
        raise SpecError("model", model_plan.untrainable_reason or f"{model_plan.name} cannot be trained")
    config = hf_config(model_plan.config, attention)
    # Seed every global generator, not just torch's: libraries draw from Python's and NumPy's too,
    # and an unseeded draw made resumed runs drift from uninterrupted ones (tests/train/test_train.py).
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    zero3 = HfDeepSpeedConfig(deepspeed_config)  # enables zero.Init only for stage 3
    whole_on = (
        None if deepspeed_config["zero_optimization"]["stage"] == 3 else (device or torch.device("cpu"))
    )
    with init_seeded_by_name(seed):
        if fp8_base:
            from dskit.train.fp8.construct import build_fp8_base

            if whole_on is None:
                raise fp8_base_zero_stage(3)
            model = build_fp8_base(model_plan.path, config=config, dtype=dtype, device=whole_on)
        elif model_plan.path:
            from dskit.train.checkpoints.hf_weights import load_pretrained

            model = load_pretrained(model_plan.path, config=config, dtype=dtype, device=whole_on)
        elif whole_on is not None:
            with torch.device(whole_on):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model._dskit_zero3 = zero3  # keeps transformers' ZeRO-3 switch on while the model lives
    # from_pretrained returns the model in eval mode: transformers then skips activation checkpointing
    # (GradientCheckpointingLayer checks self.training) and dropout, so a run from model.path silently
    # kept every layer's activations until its first eval (measured: 131 GiB where the plan said 47)
    model.train()
    if ckpt_every:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, layer in enumerate(model.model.layers):
            # every N-th layer keeps checkpointing; the others store their activations
            layer.gradient_checkpointing = i % ckpt_every == 0
    model.config.use_cache = False
    if loss_chunk_tokens:
        from dskit.train.loss import use_chunked_loss

        use_chunked_loss(model, loss_chunk_tokens)
    return model


def module_seed(seed: int, owner: str, name: str) -> int:
    """The seed of one module's random init: independent of the order modules are built in."""
    return (seed * 0x9E3779B1 + zlib.crc32(f"{owner}:{name}".encode())) % 2**63


@contextmanager
def init_seeded_by_name(seed: int) -> Iterator[None]:
    """While a model is built, seed the global generator before each module's weight init from the
    module's name (transformers initialises module by module through `_initialize_weights`; under
    ZeRO-3 it does so inside a gather on rank 0, so the full tensors are drawn the same way)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel._initialize_weights
    names: dict[int, dict[int, str]] = {}

    def seeded(self, module, *args, **kwargs):
        own = names.get(id(self))
        if own is None:
            own = names[id(self)] = {id(m): n for n, m in self.named_modules()}
        torch.manual_seed(module_seed(seed, type(self).__name__, own.get(id(module), type(module).__name__)))
        return original(self, module, *args, **kwargs)

    PreTrainedModel._initialize_weights = seeded
    try:
        yield
    finally:
        PreTrainedModel._initialize_weights = original
