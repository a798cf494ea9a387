"""Load a checkpoint in DeepSeek-V3's FP8 format (dskit/formats/hf_checkpoint.py `Fp8Format`) without a
bf16 copy.

Full fine-tuning: transformers' own loader still fills the model (ZeRO-3 partitioned or whole on the
device, per-expert tensors fused into its expert layout one layer at a time, as `model.path` loads bf16
weights), but it is handed a state dict in which each FP8 weight is an `Fp8Weight`: a deferred read
that dequantises when the loader takes the tensor, so each weight is dequantised as it is read and
freed once loaded. Scale tensors leave the state dict (each is inside its weight's `Fp8Weight`).
transformers' FP8 quantizer is not used for this: a quantized model skips `deepspeed.zero.Init`
(every rank would load the whole model), and its dequantisation derives the block size from the scale
grid, wrong wherever an edge block is partial (V3's kv_a_proj_with_mqa has 576 rows, 4.5 blocks).

Frozen FP8 base (LoRA): `swap_in_fp8_linears` replaces each nn.Linear the checkpoint holds in FP8 by
an `Fp8Linear` (dskit/train/fp8/blocks.py) filled straight from the checkpoint, 1 byte per weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dskit.errors import SpecError
from dskit.formats.hf_checkpoint import INDEX, SINGLE, Fp8Format, fp8_format, read_index
from dskit.train.fp8.blocks import Fp8Linear, dequantize_blocks

Device = torch.device | str | None


class Fp8Weight:
    """One FP8 weight of the checkpoint, dequantised to `dtype` on `device` when the loader takes it:
    by `[...]` (how transformers reads a safetensors slice) or by a call (how its weight converters
    materialise a deferred tensor). `weight` and `scale` are safetensors slices or mmap'd tensors."""

    def __init__(
        self, weight: Any, scale: Any, block: tuple[int, int], dtype: torch.dtype, device: Device = None
    ) -> None:
        self.weight, self.scale, self.block, self.dtype, self.device = weight, scale, block, dtype, device

    def __call__(self) -> torch.Tensor:
        w, s = self.weight[...], self.scale[...]
        if self.device is not None:
            w, s = w.to(self.device), s.to(self.device)  # 1 byte per weight crosses, not 2
        return dequantize_blocks(w, s, self.block, self.dtype)

    def __getitem__(self, index: Any) -> torch.Tensor:
        if index is not Ellipsis:
            raise TypeError("an Fp8Weight is read whole ([...])")
        return self()


def shard_files(path: str) -> dict[str, Path]:
    """Tensor name -> the shard holding it (the index's weight_map, or the single file's names)."""
    from safetensors import safe_open

    root = Path(path)
    if (root / INDEX).is_file():
        return {name: root / f for name, f in read_index(root / INDEX).items()}
    with safe_open(root / SINGLE, framework="pt") as f:
        return {name: root / SINGLE for name in f.keys()}


@contextmanager
def open_shards(path: str) -> Iterator[dict[str, Any]]:
    """Tensor name -> its open safetensors file (memory-mapped), open while the context lasts."""
    from safetensors import safe_open

    files = shard_files(path)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in sorted(set(files.values()))}
        yield {name: handles[f] for name, f in files.items()}


@contextmanager
def fp8_state_dict(
    path: str, fmt: Fp8Format, *, dtype: torch.dtype, device: Device = None, values: str = "slice"
) -> Iterator[dict[str, Any]]:
    """The checkpoint as transformers' loader takes it, FP8 weights deferred as `Fp8Weight`s.

    values: "slice" (ZeRO-1/2: safetensors slices, read when loaded), "tensor" (ZeRO-3's rank 0:
    memory-mapped tensors, as transformers' `load_state_dict` gives it) or "meta" (ZeRO-3's other
    ranks, which only need names and shapes; FP8 weights appear as `dtype`)."""
    scales = {fmt.scale_of(w) for w in fmt.weights}
    with open_shards(path) as shards:
        sd: dict[str, Any] = {}
        for name, f in shards.items():
            if name in scales:
                continue
            read = f.get_slice if values == "slice" else f.get_tensor
            if name in fmt.weights and values == "meta":
                sd[name] = torch.empty(f.get_slice(name).get_shape(), dtype=dtype, device="meta")
            elif name in fmt.weights:
                scale = fmt.scale_of(name)
                sd[name] = Fp8Weight(read(name), shards[scale].get_tensor(scale), fmt.block, dtype, device)
            else:
                t = read(name)
                sd[name] = torch.empty_like(t, device="meta") if values == "meta" else t
        yield sd


LAYER = re.compile(r"\.layers\.(\d+)\.")


@contextmanager
def zero3_loads_layer_by_layer() -> Iterator[None]:
    """While transformers loads a ZeRO-3 model, feed it one decoder layer at a time, dequantising that
    layer's FP8 weights just before: its ZeRO-3 loader keeps every tensor it is given until the end,
    fine for memory-mapped ones, the whole model for dequantised ones. FP8 weights the model does not
    hold by name (per-expert tensors it fuses) stay deferred for its converters, which read them one
    layer at a time themselves."""
    import transformers.modeling_utils as mu

    original = mu._load_state_dict_into_zero3_model

    def by_layer(model, state_dict, load_config=None):
        model_keys = set(model.state_dict())
        groups: dict[Any, dict[str, Any]] = {}
        for k, v in state_dict.items():
            m = LAYER.search(k)
            groups.setdefault(int(m.group(1)) if m else -1, {})[k] = v
        errors, missing = [], None
        for key in sorted(groups):
            group = {
                k: v() if isinstance(v, Fp8Weight) and k in model_keys else v
                for k, v in groups.pop(key).items()
            }
            e, m = original(model, group, load_config)
            errors.extend(e)
            missing = set(m) if missing is None else missing & set(m)
            del group
        return errors, missing or set()

    mu._load_state_dict_into_zero3_model = by_layer
    try:
        yield
    finally:
        mu._load_state_dict_into_zero3_model = original


def swap_in_fp8_linears(model: nn.Module, path: str, *, device: Device = None) -> list[str]:
    """Replace every nn.Linear of `model` whose `<name>.weight` the checkpoint at `path` holds in FP8 by
    a frozen `Fp8Linear` read straight from the checkpoint (e4m3 weight, float32 scales, bias if any:
    never dequantised, 1 byte per weight on `device`). The model may be on the meta device: nothing of
    the replaced layers is read. Returns the replaced modules' names; the rest of the checkpoint is the
    caller's to load. Routed experts in transformers' fused layout are not nn.Linear and stay as they are."""
    fmt = fp8_format(path)
    if fmt is None or not fmt.weights:
        raise SpecError("model.path", f"{path} holds no FP8 weights (DeepSeek-V3's format) to keep in FP8")
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and f"{name}.weight" in fmt.weights
    ]
    with open_shards(path) as shards:

        def read(name: str) -> torch.Tensor | None:  # a copy: the memory map closes with the shards
            return shards[name].get_tensor(name).to(device=device, copy=True) if name in shards else None

        for name, old in targets:
            w = f"{name}.weight"
            new = Fp8Linear(read(w), read(fmt.scale_of(w)), read(f"{name}.bias"), fmt.block)
            if (new.out_features, new.in_features) != (old.out_features, old.in_features):
                raise SpecError(
                    "model.path",
                    f"{path}: {w} is {list(new.weight.shape)}; the model's {name} is "
                    f"[{old.out_features}, {old.in_features}]",
                )
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
    return [name for name, _ in targets]
