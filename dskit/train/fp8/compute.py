"""FP8 training compute (the spec's `training.fp8`): the linears and, where the plan says so, the routed
experts' grouped GEMMs run in FP8 through torchao, with bf16 weights, gradients and optimizer states as before.

Which products run in FP8 is the plan's decision (dskit/plan/fp8_training.py: `parallel.fp8_linears`, by role such
as `self_attn.o_proj`, and `parallel.fp8_experts`), made from measurements: FP8 pays only where a GEMM is
large enough to amortise its casts, and only compiled (bench/results/training/h100-fp8-gemm-v3-2026-12-05.json).

Nothing here changes what a checkpoint or an export holds: a converted linear is still an `nn.Linear` with
its `weight` (only its forward changes: the product through torchao's FP8 matmul, compiled once per shape),
and the experts keep AutoEP's `w1`/`w2`/`w3`. So ZeRO 1-3 partition and gather the same parameters (ZeRO-3's
hooks run around the forward, outside the compiled product), resume reads the same names, `dskit export`
writes bf16, and peft wraps a converted linear like any other.
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from dskit.refusals import FP8_MIN_CAPABILITY

ALIGN = 16  # FP8 tensor-core GEMMs: both sides of every operand, and each expert's row group
_LAYER = re.compile(r"^(?:.*\.)?layers\.\d+\.")  # `model.layers.7.self_attn.o_proj` -> `self_attn.o_proj`


def role(name: str) -> str:
    """A linear's name without its layer: the unit the plan decides FP8 for (`self_attn.o_proj`)."""
    return _LAYER.sub("", name)


@dataclass
class Converted:
    """What ran in FP8, recorded beside the run's other kernels (construction-rankN.json's `ran.fp8`)."""

    recipe: str
    linears: list[str] = field(default_factory=list)  # module names
    expert_layers: int = 0

    def as_record(self) -> dict:
        return {
            "recipe": self.recipe,
            "linears": len(self.linears),
            "roles": sorted({role(n) for n in self.linears}),
            "linear_kernel": f"torchao float8 {self.recipe} matmul, torch.compile",
            "expert_layers": self.expert_layers,
            "experts_kernel": "torchao fp8 rowwise scaled grouped_mm" if self.expert_layers else None,
        }


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def device_unmet(device: torch.device) -> str | None:
    """Why the device a rank landed on cannot run FP8 training, or None (the plan's rule, dskit/plan/fp8_training.py,
    read off the device instead of the catalog)."""
    if device.type != "cuda":
        return "has no FP8 tensor cores"
    cc = torch.cuda.get_device_capability(device)
    if cc < FP8_MIN_CAPABILITY:
        return f"(compute capability {cc[0]}.{cc[1]}) has no FP8 grouped GEMM for the routed experts (9.0 needed)"
    return None


@functools.cache
def fp8_product(recipe: str, *, emulate: bool = False, compiled: bool = True) -> Callable:
    """x @ weight.T through torchao's FP8 matmul with `recipe`'s scaling, its casts fused by torch.compile.
    One function for every linear, so it compiles once per (input, weight) shape, not once per module: eager,
    the casts cost more than FP8 saves (0.1-0.5x bf16's speed at V3's widths on an H100). `emulate` casts in
    plain torch, for hosts without FP8 tensor cores: to check the wiring, never to train."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    config = Float8LinearConfig.from_recipe_name(recipe)
    # pad_inner_dim: the weight gradient's product runs over the tokens, and FP8 GEMMs want every side a
    # multiple of 16; a micro-step of 1000 or 504 tokens is padded (zeros) rather than refused by the kernel
    config = Float8LinearConfig(**{**config.__dict__, "emulate": emulate, "pad_inner_dim": True})
    template = Float8Linear.from_float(nn.Linear(ALIGN, ALIGN, bias=False, device="meta"), config)
    mm_config, config = template.linear_mm_config, template.config

    def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)

    if not compiled:
        return product
    # one graph per shape: a model's few linear shapes, in training and eval, times the padded widths
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    return torch.compile(product, dynamic=False)


def _fp8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return self._dskit_fp8(x, self.weight)


def convert_linears(
    model: nn.Module, recipe: str, roles: Iterable[str], *, emulate: bool = False, compiled: bool = True
) -> Converted:
    """Route the forward of every bias-free `nn.Linear` of `model` whose role is in `roles` through the FP8
    product. Before `deepspeed.initialize` (ZeRO hooks the same modules either way) and before LoRA attaches,
    so an adapter's base layer is the FP8 one. A role the model lacks converts nothing (the plan names
    roles from the model's config; the record says what was converted). Nothing to convert builds no product:
    torch.compile's limits stay as the run's other compiled regions set them."""
    roles = set(roles)
    done = Converted(recipe)
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if type(mod) is nn.Linear and mod.bias is None and role(name) in roles
    ]
    if not targets:
        return done
    product = fp8_product(recipe, emulate=emulate, compiled=compiled)
    for name, mod in targets:
        mod._dskit_fp8 = product
        mod.forward = types.MethodType(_fp8_forward, mod)
        done.linears.append(name)
    return done


def pad_expert_groups() -> None:
    """AutoEP pads each local expert's token group to TOKEN_GROUP_ALIGN_SIZE_M rows (8): the FP8 grouped
    GEMM needs 16. AutoEP reads the constant at each call (deepspeed/module_inject/auto_ep_layer.py)."""
    from deepspeed.moe import ep_kernels

    ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M = max(ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M, ALIGN)


def _fp8_experts_forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """AutoEP's grouped-GEMM SwiGLU (deepspeed/moe/ep_experts.py `_run_experts_grouped_mm`), each of its
    three products FP8 with rowwise scales (torchao's differentiable scaled grouped GEMM)."""
    from deepspeed.moe.ep_experts import apply_expert_activation
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as fp8_mm

    offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)

    def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # w [E, out, in] -> [E, in, out], column-major per expert as the kernel requires
        return fp8_mm(a, w.to(a.dtype).transpose(-2, -1), offs, pad_token_groups_for_grouped_mm=False)

    h = apply_expert_activation(
        mm(x, self.w1), mm(x, self.w3), self.activation, self.activation_alpha, self.activation_limit
    )
    return mm(h, self.w2).type_as(x)


def convert_experts(model: nn.Module) -> int:
    """Give every AutoEP `GroupedExperts` of `model` (after the engine's replacement) the FP8 forward;
    returns how many were converted. Same parameters, so ZeRO-3's gathers and the checkpoints see no
    change. The plan asks for it only where the experts' sides are multiples of 16 (dskit/plan/fp8_training.py)."""
    from deepspeed.moe.ep_experts import GroupedExperts

    pad_expert_groups()
    n = 0
    for mod in model.modules():
        if isinstance(mod, GroupedExperts):
            mod.forward = types.MethodType(_fp8_experts_forward, mod)
            n += 1
    return n
