"""LoRA on the routed experts under AutoEP: one adapter per expert, applied as a weight delta.

AutoEP (DeepSpeed 0.19.8) replaces each HF MoE block inside `deepspeed.initialize` with an
`AutoEPMoELayer` whose `GroupedExperts` holds this rank's E_local experts as three 3-D parameters,
w1 (gate) and w3 (up) [E_local, I, H] and w2 (down) [E_local, H, I], all [experts, out, in]. peft's
wrappers on transformers' fused experts do not survive that repacking, so the adapters are attached
to `GroupedExperts` after the replacement (`after_autoep`, before ZeRO or the optimizer sees the
parameters): each rank holds only its local experts' A [E_local, r, in] and B [E_local, out, r].

Design: a weight delta on the fly, W_eff = W + (alpha / r) B @ A per expert, registered with
`torch.nn.utils.parametrize` on w1/w2/w3 (what peft's `ParamWrapper` does for `target_parameters` on
3-D expert weights). Why, against the unmerged low-rank path x A^T B^T:
- exact and kernel-agnostic: every AutoEP path (torch._grouped_mm, fused gate-up, Triton, the CPU
  for-loop) reads `experts.w1` and runs unchanged; the unmerged path needs a grouped GEMM pair per
  projection inside each of them, i.e. a fork of AutoEP's expert forward;
- it composes: a parametrization registered first (the FP8 base's dequantisation on the same
  w1/w2/w3) hands this one the dequantised weight, and `register_parametrization` appends.
Its price, counted by the plan (dskit/plan/adapters.py): (1) FLOPs: autograd needs dL/dW_eff to reach A and B,
so the routed experts' weight-gradient GEMM, which a frozen expert skips, runs again: 2 FLOPs per
active routed weight per token (6 instead of 4, +50 % on the routed experts), plus 6 r in out per
local expert and projection per micro-step to form B A and take its gradients, against 6 r (in + out)
per routed token for x A^T B^T; (2) memory: the bf16 W_eff of a layer's local experts is kept for
backward (the GEMMs save their weight operand) unless the layer is checkpointed, and its gradient
exists while the layer's backward runs. By count, one V2-Lite MoE layer (h 2048, I 1408, r 16, 8 local
experts, 4096 routed token-slots) adds 77.5 GFLOP per forward + backward with the delta against 4.1 for
x A^T B^T, on a frozen layer's ~142, and keeps 132 MiB of W_eff against 0.4 MiB. Measured on the
development CPU (`python -m bench.routed_lora_delta`, bf16, AutoEP's for-loop path, 2 shared cores):
frozen 1.03 s, delta 3.12 s, unmerged 3.20 s per pass, the same adapter gradients (9e-3 relative, bf16):
on this CPU the skinny r-wide GEMMs cost as much as the delta's extra work, so the measurement does
not separate them; on a GPU the FLOP count favours the unmerged path, not measured. The delta was
chosen for exactness, kernel independence and FP8 composition; the unmerged path is the speed-up.

Dropout: peft's lora_dropout drops the adapter's *input*, which a weight delta never sees (peft's
ParamWrapper refuses it too); `routed_experts` with dropout > 0 is refused by the spec.

Seeding: A of global expert e, projection w of layer `model.layers.N.mlp` is drawn from
(seed, "model.layers.N.mlp.experts.w.lora_A.e") with peft's kaiming-uniform rule; B is zero. The
draw depends on the global expert index, not the rank, so a run's adapters do not depend on EP size.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dskit.plan.schema import FinetunePlan

log = logging.getLogger("dskit.train")

#: AutoEP's projections: (GroupedExperts parameter, transformers' projection it holds)
PROJECTIONS = (("w1", "gate"), ("w3", "up"), ("w2", "down"))
#: a routed adapter's parameter inside the model (the parametrization's index depends on what was
#: registered before it, e.g. an FP8 dequantisation) -> its checkpoint name
_IN_MODEL = re.compile(r"\.experts\.parametrizations\.(w[123])\.\d+\.lora_([AB])$")
#: a routed adapter's checkpoint name: `model.layers.N.mlp.experts.w1.lora_A`, all experts stacked
CHECKPOINT_NAME = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(w[123])\.lora_([AB])$")


class ExpertDelta(nn.Module):
    """The parametrization W -> W + scale * B @ A for [experts, out, in] weights (AutoEP's layout)."""

    def __init__(self, experts: int, out_features: int, in_features: int, r: int, scale: float, dtype):
        super().__init__()
        self.scale = scale
        self.lora_A = nn.Parameter(torch.zeros(experts, r, in_features, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(experts, out_features, r, dtype=dtype))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        # in the weight's dtype, as peft's ParamWrapper does; w may be the output of an earlier
        # parametrization (the FP8 base's dequantised weight)
        delta = torch.bmm(self.lora_B.to(w.dtype), self.lora_A.to(w.dtype))
        return w + self.scale * delta


def checkpoint_name(model_name: str) -> str:
    """A routed adapter's name in dskit's checkpoint (unchanged for every other parameter)."""
    return _IN_MODEL.sub(r".experts.\1.lora_\2", model_name)


def is_routed(name: str) -> bool:
    return CHECKPOINT_NAME.match(name) is not None


def seed_name(layer: str, proj: str, expert: int) -> str:
    return f"{layer}.experts.{proj}.lora_A.{expert}"


def _moe_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    for name, m in model.named_modules():
        if isinstance(m, AutoEPMoELayer):
            yield name, m


def local_experts(layer: nn.Module) -> list[int]:
    """Global indices of the experts this rank holds, in GroupedExperts' order."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    return list(autoep_experts_for_rank(layer.expert_placement_descriptor, layer.ep_rank))


def experts_of_rank(layer: nn.Module, ep_rank: int) -> list[int]:
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    return list(autoep_experts_for_rank(layer.expert_placement_descriptor, ep_rank))


def attach_routed(model: nn.Module, f: FinetunePlan, *, seed: int, dtype: torch.dtype, to_zero=None) -> int:
    """Register an ExpertDelta on every AutoEP layer's w1/w2/w3 (after any parametrization already
    there); returns this rank's adapter parameter count. `to_zero`: ZeRO-3's converter, which
    partitions the new parameters over the experts' data-parallel group as AutoEP does its experts."""
    from deepspeed.utils import groups
    from torch.nn.utils import parametrize

    from dskit.train.model import module_seed

    local, ep_size, new = 0, 1, []
    for name, layer in _moe_layers(model):
        experts, ids, ep_size = layer.experts, local_experts(layer), layer.ep_size
        for proj, _ in PROJECTIONS:
            # the shape without computing the weight: an FP8 base's parametrization would dequantise it
            w = (
                experts.parametrizations[proj].original
                if parametrize.is_parametrized(experts, proj)
                else getattr(experts, proj)
            )
            e, out_f, in_f = getattr(w, "ds_shape", w.shape)
            delta = ExpertDelta(e, out_f, in_f, f.r, f.alpha / f.r, dtype)
            with torch.no_grad():
                for i, g in enumerate(ids):
                    gen = torch.Generator().manual_seed(module_seed(seed, "lora", seed_name(name, proj, g)))
                    a = torch.empty(f.r, in_f, dtype=torch.float32)
                    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # peft's own rule
                    delta.lora_A[i].copy_(a)
            delta.to(w.device)
            for p in delta.parameters():
                # expert parameters, as AutoEP tags its own (auto_ep_layer.py): reduced over the experts'
                # data-parallel group only, in the optimizer's MoE groups
                p.allreduce = False
                p.group_name = layer.ep_group_name
                p.ds_zero_placement_family = "autoep_expert"
                p.ds_zero_partition_group_name = layer.ep_group_name
                local += p.numel()
                new.append(p)
            # unsafe: under ZeRO-3 the weight is a partition here (empty), so the shape check that
            # evaluates the parametrization cannot run; the delta keeps shape and dtype by construction
            parametrize.register_parametrization(experts, proj, delta, unsafe=True)
    if to_zero is not None and new:
        for p in new:
            p.ds_zero_partition_process_group = groups._get_expert_data_parallel_group(p.group_name)
        to_zero(param_list=new)
    if local * ep_size != f.routed_adapter_params:
        raise RuntimeError(
            f"attached {local} routed adapter parameters on this rank (x ep {ep_size}), the plan counted "
            f"{f.routed_adapter_params}: dskit/plan/adapters.py and AutoEP's layers disagree"
        )
    log.info(
        "LoRA r %d on the routed experts: %d adapter parameters on this rank (EP %d)", f.r, local, ep_size
    )
    return local


@contextmanager
def after_autoep(f: FinetunePlan, *, seed: int, dtype: torch.dtype) -> Iterator[None]:
    """While the engine is built, attach the routed adapters right after AutoEP's replacement
    (`DeepSpeedEngine._configure_expert_parallel`), before the engine places the model, ZeRO hooks
    its modules or the optimizer reads the parameters. AutoEP runs only inside the engine (it needs
    the engine's EP groups), so this is the one point where the experts exist and nothing has read them."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_expert_parallel

    def configure(self, model, collect_sources=None):
        sources = original(self, model, collect_sources)
        attach_routed(model, f, seed=seed, dtype=dtype, to_zero=self._autoep_zero3_param_converter(model))
        return sources

    DeepSpeedEngine._configure_expert_parallel = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_expert_parallel = original


def gather_experts(engine, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collective over each layer's EP group: this rank's [E_local, ...] routed adapters -> [E, ...] by
    global expert index (every rank gets all of them)."""
    import torch.distributed as dist

    layers = dict(_moe_layers(engine.module))
    out = {}
    for name in sorted(local):
        m = CHECKPOINT_NAME.match(name)
        layer = layers[m.group(1)]
        t = local[name]
        parts = [torch.empty_like(t) for _ in range(layer.ep_size)]
        dist.all_gather(parts, t.contiguous(), group=layer.ep_group)
        whole = torch.empty((layer.num_experts, *t.shape[1:]), dtype=t.dtype, device=t.device)
        for k, part in enumerate(parts):
            whole[experts_of_rank(layer, k)] = part
        out[name] = whole
    return out


def local_part(engine, name: str, whole: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a checkpoint's [E, ...] routed adapter."""
    layer = dict(_moe_layers(engine.module))[CHECKPOINT_NAME.match(name).group(1)]
    return whole[local_experts(layer)]
