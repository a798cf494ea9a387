"""`dskit export --fp8`: the exported weights in the FP8 format DeepSeek publishes V3 in, which serving
engines load as V3's own checkpoint (its config.json `quantization_config`; dskit reads the same format as
an FP8 base, dskit/formats/hf_checkpoint.py `check_fp8`).

- Every projection of attention and of the MLPs (`*_proj.weight`, `kv_a_proj_with_mqa.weight`), the routed
  experts' included, is e4m3 with a float32 `weight_scale_inv` per 128 x 128 block (DeepSeek's rule:
  the block's amax over 448, `dskit/train/fp8/blocks.py quantize_blocks`), quantized from the trained
  float32 master weights;
- the routed experts are written one tensor per expert and projection (`mlp.experts.E.gate_proj.weight`),
  as the published checkpoints hold them, not transformers' fused `gate_up_proj` [E, 2I, H];
- the embedding, the norms, the router and the output head stay in the run's precision, the routing
  bias in float32, as in V3's checkpoint.

Like the bf16 export it streams: one fused expert tensor and one quantized weight in memory at a time.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from dskit.formats.hf_checkpoint import FP8_BLOCK

if TYPE_CHECKING:
    import torch

#: a config.json `quantization_config` as DeepSeek-V3's
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(FP8_BLOCK),
}
#: the weights V3's checkpoint holds in FP8: every linear projection (not the router's `mlp.gate.weight`)
QUANTIZED = re.compile(r"(_proj|_proj_with_mqa)\.weight$")
#: transformers' fused routed experts: [E, 2I, H] gate and up, [E, H, I] down
FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
SCALE_SUFFIX = "_scale_inv"

#: an exported tensor -> (the model's tensor it comes from, the expert, the rows of it: None for all)
Source = tuple[str, int | None, tuple[int, int] | None]
TensorOf = Callable[[str, tuple[int, ...], "torch.dtype"], "torch.Tensor"]


def layout(shapes: dict) -> tuple[dict, dict[str, Source]]:
    """(the FP8 export's tensors as name -> (shape, dtype), in the model's order; where each comes from)
    from the bf16 export's `shapes`."""
    import torch

    from dskit.train.fp8.blocks import E4M3, block_grid

    out: dict = {}
    source: dict[str, Source] = {}

    def put(name: str, shape: tuple[int, ...], dtype: torch.dtype, src: Source) -> None:
        if QUANTIZED.search(name):
            out[name] = (shape, E4M3)
            out[name + SCALE_SUFFIX] = (block_grid(shape, FP8_BLOCK), torch.float32)
            source[name + SCALE_SUFFIX] = src
        else:
            out[name] = (shape, dtype)
        source[name] = src

    for name, (shape, dtype) in shapes.items():
        m = FUSED_EXPERTS.match(name)
        if m is None:
            put(name, shape, dtype, (name, None, None))
            continue
        experts, rows, cols = shape
        for e in range(experts):
            base = f"{m['prefix']}.{e}"
            if m["kind"] == "down_proj":
                put(f"{base}.down_proj.weight", (rows, cols), dtype, (name, e, None))
            else:  # gate is the first half of the fused rows, up the second
                half = rows // 2
                put(f"{base}.gate_proj.weight", (half, cols), dtype, (name, e, (0, half)))
                put(f"{base}.up_proj.weight", (half, cols), dtype, (name, e, (half, rows)))
    return out, source


def tensors(shapes: dict, source: dict[str, Source], tensor_of: TensorOf) -> TensorOf:
    """`tensor_of` for the FP8 layout, reading the model's tensors through the bf16 export's `tensor_of`
    (in float32, so each block is quantized from the master weights)."""
    import torch

    from dskit.train.fp8.blocks import quantize_blocks

    @functools.lru_cache(maxsize=1)  # an expert tensor's slices are written one after another
    def whole(name: str) -> torch.Tensor:
        return tensor_of(name, shapes[name][0], torch.float32)

    @functools.lru_cache(maxsize=1)  # a weight, then its scale
    def quantized(weight: str) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_blocks(part(weight), FP8_BLOCK)

    def part(name: str) -> torch.Tensor:
        fused, expert, rows = source[name]
        t = whole(fused)
        if expert is not None:
            t = t[expert]
        if rows is not None:
            t = t[rows[0] : rows[1]]
        return t

    def of(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name.endswith(SCALE_SUFFIX) and QUANTIZED.search(name.removesuffix(SCALE_SUFFIX)):
            t = quantized(name.removesuffix(SCALE_SUFFIX))[1]
        elif QUANTIZED.search(name):
            t = quantized(name)[0]
        else:
            t = part(name).to(dtype)
        if tuple(t.shape) != tuple(shape):
            raise RuntimeError(f"{name}: built {tuple(t.shape)}, the layout says {shape}")
        return t.contiguous()

    return of


#: each weight as transformers dequantizes the export, against the trained one: relative L2 error. e4m3
#: keeps 3 mantissa bits (rounding error up to 1/16 of a value); measured 0.026-0.027 on tiny-v2 (against
#: its bf16 export), where a tensor read into another's place (gate for up) is off by 1.41
WEIGHT_RTOL = 0.06


def check_weights(model_dir, shapes: dict, tensor_of: TensorOf) -> int:
    """Load the export with transformers (which dequantizes FP8 on a CPU) and compare every tensor of the
    model with the trained one, by transformers' own reading of the layout: a tensor put in another's
    place fails here even where the logits barely move. Returns how many tensors were compared."""
    import torch
    from transformers import AutoModelForCausalLM

    # bf16 as served (half the memory of float32; its rounding is 1/16 of e4m3's)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True)
    loaded = model.state_dict()
    if set(loaded) != set(shapes):
        missing, extra = sorted(set(shapes) - set(loaded)), sorted(set(loaded) - set(shapes))
        raise RuntimeError(f"the FP8 export loads as another model: missing {missing[:3]}, extra {extra[:3]}")
    for name, (shape, _) in shapes.items():
        want = tensor_of(name, shape, torch.float32).float()
        got = loaded[name].float()
        err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        if not err < WEIGHT_RTOL:
            raise RuntimeError(
                f"the FP8 export's {name} reads back {err:.3g} off the trained weights (relative L2, at most "
                f"{WEIGHT_RTOL}): not where transformers expects it"
            )
    del model, loaded
    return len(shapes)
