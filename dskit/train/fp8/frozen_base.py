"""An FP8 frozen base under LoRA (`finetune.base_precision: fp8`): DeepSeek-V3's FP8 bytes kept on the device.

Construction (ZeRO-1/2 only: the plan refuses ZeRO-3, see below):
1. `fp8_build.build_fp8_base` creates the model on the meta device and fills it from model.path onto
   the GPU: every nn.Linear whose weight the checkpoint holds in FP8 (attention projections, shared
   experts, dense MLP) as an `Fp8Linear` of the checkpoint's own e4m3 bytes and scales, everything
   else in its declared dtype, the routed experts left on the meta device. No bf16 copy of the base
   exists on disk, in host memory or on the device. peft then wraps the targeted FP8 linears
   (`Fp8LoraLinear`, registered as a custom module on the LoraConfig).
2. `experts_stay_fp8`: while `deepspeed.initialize` runs, each MoE block AutoEP replaces gets its
   rank's routed experts (`w1`/`w2`/`w3` of `GroupedExperts`, on the meta device as AutoEP copied them
   from the meta model) in FP8: the checkpoint's bytes for the experts AutoEP's placement gives this
   rank, as the original of a `torch.nn.utils.parametrize` parametrization that dequantises on access.
   It hooks AutoEP's per-layer replacement, so it runs after the replacement and before ZeRO builds the
   optimizer, one layer at a time.
   The experts' forward then saves references to those FP8 bytes for the backward instead of the
   dequantised weights its GEMMs would keep (`save_experts_as_fp8`).

Why peft's custom-module dispatch and not an nn.Linear subclass: peft 0.21.2's default dispatch takes
any nn.Linear, but so does everything else that walks a model (transformers' weight init, peft's merge,
`.to(dtype)` helpers), and each would read or write `weight` as a bf16/fp32 Parameter; a separate class
fails loudly where it is not expected. `LoraConfig._register_custom_module({Fp8Linear: Fp8LoraLinear})`
is peft's documented (experimental) hook, tried before its default dispatch.

Why ZeRO-3 is refused: `Fp8Linear` holds buffers, which ZeRO-3 never partitions, so every rank would hold
the whole FP8 base (the plan counts it sharded); as frozen float8 parameters instead, DeepSpeed 0.19.8
partitions them but its all-gather fails on gloo ("Invalid scalar type", tests/support/zero3_float8_probe.py).

On GPU the dequantisation is plain torch per block (no FP8 GEMM yet): what the CPU tests can check.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from dskit.errors import SpecError
from dskit.formats.hf_checkpoint import Fp8Format, fp8_format
from dskit.refusals import no_fp8_checkpoint
from dskit.train.fp8.blocks import Fp8Linear, dequantize_blocks

log = logging.getLogger("dskit.train")

#: GroupedExperts' weights (deepspeed/moe/ep_experts.py) -> the per-expert projection DeepSeek ships
EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def checkpoint_format(path: str | None) -> Fp8Format:
    """model.path's FP8 format, or SpecError: an fp8 base is read from DeepSeek-V3's FP8 checkpoint."""
    fmt = fp8_format(path) if path else None
    if fmt is None or not fmt.weights:
        raise no_fp8_checkpoint(path)
    return fmt


def _lora_linear_class() -> type:
    from peft.tuners.lora import Linear

    class Fp8LoraLinear(Linear):
        """peft's LoRA Linear on an `Fp8Linear` base: the base's forward (dequantise per block, frozen)
        plus the adapters. Merging into the base is refused: that is dskit export's job, dequantised."""

        def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
            return module.in_features, module.out_features

        def _get_base_layer_device_and_dtype(self, base_layer: nn.Module):
            # the adapters go to the base's device but not its dtype (e4m3): dskit casts them (lora.attach)
            return base_layer.weight.device, None

        def merge(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError("an FP8 base is merged by `dskit export`, dequantised to bf16")

        def get_delta_weight(self, adapter: str) -> torch.Tensor:
            raise NotImplementedError("an FP8 base is merged by `dskit export`, dequantised to bf16")

    return Fp8LoraLinear


def register_fp8_lora(config: Any) -> None:
    """Tell peft (LoraConfig) how to wrap an `Fp8Linear` base."""
    config._register_custom_module({Fp8Linear: _lora_linear_class()})


class DequantizedBlocks(nn.Module):
    """A parametrization whose original is an e4m3 tensor [..., N, K] and which returns it dequantised
    per 128 x 128 block (DeepSeek's rule, dskit/train/fp8/blocks.py) in `dtype`. The scales are a buffer here
    (float32: DeepSpeed casts float32 parameters, not buffers). It has no right_inverse: the base is
    frozen, nothing assigns to it. A second parametrization (e.g. LoRA, W + s B A) may follow it."""

    def __init__(self, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("scale_inv", scale_inv, persistent=False)
        self.block, self.dtype = tuple(block), dtype

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        return dequantize_blocks(original, self.scale_inv, self.block, self.dtype)


class _SavedFp8:
    """What autograd keeps in place of a dequantised expert weight (or a view of it) saved for backward:
    which weight, and the view's geometry. No tensor: the bf16 weight is rebuilt from FP8 when needed."""

    __slots__ = ("attr", "size", "stride", "offset")

    def __init__(self, attr: str, t: torch.Tensor) -> None:
        self.attr, self.size, self.stride, self.offset = attr, t.size(), t.stride(), t.storage_offset()


def save_experts_as_fp8(experts: nn.Module) -> None:
    """Make `experts`' forward keep its FP8 bytes, not the dequantised weights, for the backward.

    The grouped GEMMs save their weight operand (a view of the dequantised w1/w2/w3) for the input
    gradient, which would keep every MoE layer's local experts in bf16 from its forward to its backward.
    Around the forward, saved tensors that are views of the weights the parametrizations just returned
    are packed as `_SavedFp8` and dequantised again when the backward unpacks them (once per weight and
    backward). Every other saved tensor goes to the hooks already active (activation checkpointing's,
    torch.utils.checkpoint: only the innermost pair of saved-tensor hooks applies, so this pair hands
    them on), or is saved as autograd saves it. Only a weight whose sole parametrization is
    `DequantizedBlocks` is packed: after a second one (LoRA on the experts) the saved operand is that
    one's output, which this cannot rebuild."""
    from torch.nn.utils import parametrize

    inner = experts.forward

    def rebuild(attr: str) -> torch.Tensor:
        chain = experts.parametrizations[attr]
        return chain[0](chain.original)

    def forward(*args: Any, **kwargs: Any) -> Any:
        attrs = [a for a in EXPERT_PROJ if len(experts.parametrizations[a]) == 1]
        if not torch.is_grad_enabled() or not attrs:
            return inner(*args, **kwargs)
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with parametrize.cached():  # the forward reads each weight once: these very tensors
            ours = {getattr(experts, a).untyped_storage().data_ptr(): a for a in attrs}
            rebuilt: dict[str, torch.Tensor] = {}

            def pack(t: torch.Tensor) -> Any:
                attr = ours.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
                if attr is not None:
                    return _SavedFp8(attr, t)
                return outer[0](t) if outer else t

            def unpack(saved: Any) -> torch.Tensor:
                if isinstance(saved, _SavedFp8):
                    if saved.attr not in rebuilt:  # the for-loop path saves one view per expert
                        rebuilt[saved.attr] = rebuild(saved.attr)
                    return rebuilt[saved.attr].as_strided(saved.size, saved.stride, saved.offset)
                return outer[1](saved) if outer else saved

            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return inner(*args, **kwargs)

    experts.forward = forward


def _expert_fp8(
    shards: dict[str, Any], fmt: Fp8Format, layer: str, proj: str, experts: list[int], device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's e4m3 weights and scales of `experts` of one MoE layer, stacked [E_local, ...]."""
    names = [f"{layer}.experts.{e}.{proj}.weight" for e in experts]
    missing = [n for n in names if n not in fmt.weights]
    if missing:
        raise SpecError(
            "finetune.base_precision",
            f"fp8 needs every routed expert in FP8, and the checkpoint holds {missing[0]} "
            f"{'in another dtype' if missing[0] in shards else 'not at all'}; use bf16",
        )

    def read(name: str) -> torch.Tensor:
        return shards[name].get_tensor(name)

    w = torch.stack([read(n) for n in names]).to(device)
    s = torch.stack([read(fmt.scale_of(n)) for n in names]).to(device)
    return w, s


def _owned_experts(replacement: nn.Module, ep_rank: int) -> list[int]:
    """Global indices of the experts `ep_rank` holds, in GroupedExperts' order: AutoEP's placement
    (routed_lora reads the same), or its default contiguous slice where a layer carries none."""
    descriptor = getattr(replacement, "expert_placement_descriptor", None)
    if descriptor is None:
        local = replacement.num_local_experts
        return list(range(ep_rank * local, (ep_rank + 1) * local))
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    return list(autoep_experts_for_rank(descriptor, ep_rank))


def requantize_experts(
    replacement: nn.Module,
    layer: str,
    *,
    ep_rank: int,
    shards: dict[str, Any],
    fmt: Fp8Format,
    device: Any = None,
) -> int:
    """Step 3 for one AutoEP layer: its GroupedExperts' w1/w2/w3 become parametrized, originals the
    checkpoint's FP8 bytes for this rank's experts, on the device of AutoEP's copy (or `device` where
    that is the meta device: the base built by dskit/train/fp8/construct.py, nothing to compare with). A
    real copy (dequantised from the same bytes) is checked: equal, or the expert slicing is not
    AutoEP's. Returns the FP8 bytes now held."""
    from torch.nn.utils import parametrize

    experts = replacement.experts
    owned = _owned_experts(replacement, ep_rank)
    held = 0
    for attr, proj in EXPERT_PROJ.items():
        old = getattr(experts, attr)
        w, s = _expert_fp8(shards, fmt, layer, proj, owned, device if old.is_meta else old.device)
        same = w.shape == old.shape and (
            old.is_meta
            or all(  # one expert at a time: the check's transient stays small
                torch.equal(dequantize_blocks(w[i], s[i], fmt.block, old.dtype), old.data[i])
                for i in range(len(owned))
            )
        )
        if not same:
            raise RuntimeError(
                f"{layer}.experts.{attr}: the checkpoint's FP8 experts {owned[0]}..{owned[-1]} "
                f"{list(w.shape)} do not dequantise to what AutoEP holds {list(old.shape)}"
            )
        new = nn.Parameter(w, requires_grad=False)
        # DeepSpeed's expert tags (is_expert_group, allreduce, group_name): the broadcast and the MoE
        # bookkeeping treat the FP8 original as the expert parameter it replaces
        new.__dict__.update(old.__dict__)
        setattr(experts, attr, new)
        parametrize.register_parametrization(
            experts, attr, DequantizedBlocks(s, fmt.block, old.dtype), unsafe=True
        )
        held += w.numel() * w.element_size() + s.numel() * s.element_size()
    save_experts_as_fp8(experts)
    return held


@contextmanager
def _grouped_experts_on_meta(on: bool) -> Iterator[None]:
    """AutoEP copies a layer's local experts out of the source model into a new GroupedExperts, whose
    weights it allocates on the CPU first: from a meta source (fp8_build) that copy must be meta too
    (a CPU parameter cannot take meta data), and the FP8 bytes replace it right after."""
    if not on:
        yield
        return
    from deepspeed.moe.ep_experts import GroupedExperts

    original = GroupedExperts.__init__

    def on_meta(self, *args: Any, **kwargs: Any) -> None:
        with torch.device("meta"):
            original(self, *args, **kwargs)

    GroupedExperts.__init__ = on_meta
    try:
        yield
    finally:
        GroupedExperts.__init__ = original


@contextmanager
def experts_stay_fp8(path: str, device: Any = None) -> Iterator[dict[str, int]]:
    """While the engine is built: every MoE block AutoEP replaces keeps its rank's routed experts in FP8
    (`requantize_experts`), right after its replacement. Yields {layer name: FP8 bytes}, filled as the
    layers are replaced. Hooks AutoEP's per-layer replacement (DeepSpeed 0.19.8 auto_ep.py
    `_replace_moe_layer_without_retarget`): the engine builds the ZeRO optimizer only after it."""
    from deepspeed.module_inject.auto_ep import AutoEP

    from dskit.train.fp8.loading import open_shards

    fmt = checkpoint_format(path)
    original = AutoEP._replace_moe_layer_without_retarget
    done: dict[str, int] = {}
    with open_shards(path) as shards:

        def replace(self, spec, ep_size, ep_rank, collect_sources):
            source = self.model.get_submodule(f"{spec.moe_module_name}.{spec.experts_name}")
            with _grouped_experts_on_meta(any(p.is_meta for p in source.parameters())):
                replacement, sources = original(self, spec, ep_size, ep_rank, collect_sources)
            done[spec.moe_module_name] = requantize_experts(
                replacement, spec.moe_module_name, ep_rank=ep_rank, shards=shards, fmt=fmt, device=device
            )
            return replacement, sources

        AutoEP._replace_moe_layer_without_retarget = replace
        try:
            yield done
        finally:
            AutoEP._replace_moe_layer_without_retarget = original


def check_filled(model: nn.Module, replaced: dict[str, int]) -> None:
    """After the engine is built: every MoE layer had its experts read in FP8, and nothing of the meta
    build is left unfilled (a layer AutoEP did not replace would otherwise fail later, in a copy
    "out of meta tensor")."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    layers = [n for n, m in model.named_modules() if isinstance(m, AutoEPMoELayer)]
    missed = sorted(set(layers) - set(replaced))
    stray = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missed or stray or not layers:
        raise RuntimeError(
            f"fp8 base: {len(replaced)} of {len(layers)} MoE layers got their experts in FP8"
            + (f" (not {missed[0]})" if missed else "")
            + (f"; {len(stray)} tensors left on the meta device, e.g. {stray[0]}" if stray else "")
        )


def held_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes of the frozen base by dtype (parameters and buffers that do not train): what a test or a
    GPU run compares with the plan (`construction-rankN.json` `frozen_bytes`)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    tensors = [p for p in module.parameters() if not p.requires_grad] + list(module.buffers())
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        local = getattr(t, "ds_tensor", t)  # ZeRO-3: this rank's partition
        key = str(local.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + local.numel() * local.element_size()
    return out
