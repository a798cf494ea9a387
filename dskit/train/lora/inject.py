"""LoRA adapters on the built model: peft injects them in place, the base is frozen, adapters seeded.

`peft.inject_adapter_in_model` wraps the matched nn.Linear layers where they are, so module names stay
transformers' (`model.layers.N.self_attn.q_proj.lora_A.default.weight`): AutoEP's preset regex
(`model\\.layers\\.\\d+\\.mlp`) still finds the MoE blocks it replaces, and AutoEP keeps the shared
experts' module object, adapters included. The PeftModel wrapper would prefix every name with
`base_model.model.`. The routed experts are adapted after AutoEP's replacement instead
(dskit/train/lora/routed.py). Which modules are adapted is the plan's decision (`FinetunePlan.target_modules`,
dskit/plan/adapters.py); the trainer checks that peft injected exactly the parameters the plan counted.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dskit.plan.schema import FinetunePlan

log = logging.getLogger("dskit.train")

#: AutoEP's name for a router weight -> transformers' (AutoEP copies `mlp.gate` into `mlp.router.gate`)
_AUTOEP_ROUTER = re.compile(r"\.mlp\.router\.gate\.")
#: peft's adapter name: in the module's parameter names, not in peft's saved files
ADAPTER_NAME = "default"


def attach(model: torch.nn.Module, f: FinetunePlan, *, seed: int, dtype: torch.dtype) -> None:
    """Freeze `model`, inject `f`'s adapters (seeded by name, in `dtype`), unfreeze what trains whole."""
    from peft import LoraConfig, inject_adapter_in_model

    from dskit.train.model import module_seed

    model.requires_grad_(False)
    if f.target_modules is not None:
        config = LoraConfig(
            r=f.r,
            lora_alpha=f.alpha,
            lora_dropout=f.dropout,
            target_modules=f.target_modules,
            bias="none",
        )
        from dskit.train.fp8.blocks import Fp8Linear

        if any(
            isinstance(m, Fp8Linear) for m in model.modules()
        ):  # an fp8 base (dskit/train/fp8/frozen_base.py)
            from dskit.train.fp8.frozen_base import register_fp8_lora

            register_fp8_lora(config)
        with _no_v4_rename():
            inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    adapters = 0
    for name, p in model.named_parameters():
        if ".lora_" in name:
            # peft creates adapters in fp32 (its autocast_adapter_dtype); the engine trains them like the
            # model's own weights, in the plan's precision. A is drawn from (seed, name) as model.py
            # draws the base: every ZeRO stage, and a reference built the same way, starts alike. B
            # stays zero (peft's init): the first step's loss is the base model's.
            p.data = p.data.to(dtype)
            if ".lora_A." in name:
                g = torch.Generator().manual_seed(module_seed(seed, "lora", name))
                w = torch.empty(p.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=g)  # peft's own rule
                p.data.copy_(w)
            p.requires_grad_(True)
            adapters += p.numel()
        elif f.whole_params and re.fullmatch(f.whole_params, name):
            p.requires_grad_(True)
    # the routed experts' adapters are attached later, once AutoEP has replaced the MoE blocks
    # (dskit/train/lora/routed.py, which checks its own count)
    peft_params = f.adapter_params - f.routed_adapter_params
    if adapters != peft_params:
        raise RuntimeError(
            f"peft injected {adapters} adapter parameters, the plan counted {peft_params} "
            f"(finetune.lora.targets {f.targets}): dskit/plan/adapters.py and the model disagree"
        )
    log.info(
        "LoRA r %d on %s: %d adapter parameters from peft%s%s; the rest frozen",
        f.r,
        ", ".join(f.targets),
        adapters,
        " (the routed experts' follow once AutoEP has replaced the MoE blocks)"
        if f.routed_adapter_params
        else "",
        ", router trained whole" if f.whole_params else "",
    )


@contextmanager
def _no_v4_rename() -> Iterator[None]:
    """peft 0.21 rewrites the targets of DeepSeek configs as if they had been written for transformers
    v4's unfused experts (peft/utils/transformers_weight_conversion.py, deepseek_v2/v3 -> qwen2_moe):
    any target ending in gate_proj/up_proj/down_proj becomes the routed experts' fused parameters, so
    the shared experts and dense MLPs would lose their adapters and the routed experts gain some. The
    plan's regex names v5 modules already: the rewrite is skipped while dskit injects. (The exported
    adapter_config.json spells those targets as target_parameters, which the rewrite leaves alone:
    dskit/train/lora/export_adapter.py.)"""
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


@contextmanager
def frozen_experts_allowed() -> Iterator[None]:
    """ZeRO-1/2 (DeepSpeed 0.19.8 stage_1_and_2.py `_configure_moe_settings`) assert that a model with
    MoE layers hands the optimizer a parameter group marked MoE: with every routed expert frozen there
    is none to mark (and an empty group fails on its first element). The check is skipped while the
    engine is built only when no group is MoE; the rest of its MoE handling (expert gradient-norm
    averaging) reads `is_moe_param_group`, all False then."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._configure_moe_settings

    def configure(self) -> None:
        if any(self.is_moe_group(g) for g in self.optimizer.param_groups):
            original(self)
        else:  # what the original records for groups that are not MoE, read by the norm averaging
            self.is_moe_param_group = [False] * len(self.optimizer.param_groups)

    DeepSpeedZeroOptimizer._configure_moe_settings = configure
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer._configure_moe_settings = original


def hf_name(name: str) -> str:
    """A trainable parameter's checkpoint name: transformers' (AutoEP renames the router), or for a
    routed expert adapter `model.layers.N.mlp.experts.w1.lora_A` (dskit/train/lora/routed.py)."""
    from dskit.train.lora.routed import checkpoint_name

    return checkpoint_name(_AUTOEP_ROUTER.sub(".mlp.gate.", name))


def trainable(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters a LoRA run trains and checkpoints, by transformers name."""
    return {hf_name(n): p for n, p in module.named_parameters() if p.requires_grad}
