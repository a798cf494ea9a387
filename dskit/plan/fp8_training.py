"""Whether and where a run computes in FP8 (`training.fp8`): the user's choice, since it changes the
numerics; the plan checks the GPU can, names the recipe, and decides which products go FP8 from measurements
(the trainer converts them: dskit/train/fp8/compute.py).

Measured on one H100 with torchao 0.18 and torch 2.11 by bench/fp8_gemm_bench.py (bench/results/training/
h100-fp8-gemm-v3-2026-12-05.json and h100-fp8-gemm-v2-lite-2026-12-05.json), each product forward + backward
at 8,192 tokens a micro-step:
- a linear in FP8 pays only compiled, and only large: tensorwise 1.10-1.58x bf16 where in x out >= 14.7M
  elements and both sides >= 1,536 (V3's q_b_proj, o_proj, shared experts, dense MLP; V2-Lite's dense MLP
  0.96-1.17x); smaller ones lose (MLA's kv_a 0.45-0.81x, kv_b 0.41-0.71x, V2-Lite's attention 0.94-0.95x).
  Rowwise pays less (1.20-1.24x on the largest) but its loss stays closer to bf16's.
- the routed experts' FP8 grouped GEMM loses at both widths (0.65x V2-Lite, 0.88x V3): they stay bf16
  unless `overrides.fp8_experts=on`.
"""

from __future__ import annotations

from dskit.catalog import GPU
from dskit.errors import SpecError
from dskit.plan.shape import ModelShape
from dskit.refusals import FP8_MIN_CAPABILITY, fp8_compute_unsupported

FASTEST = "tensorwise"  # what `on` resolves to: the faster recipe in every row measured faster than bf16
MIN_ELEMENTS = 14_680_064  # in x out of the smallest linear measured faster in FP8 (7168 x 2048)
MIN_SIDE = 1536  # its shortest side (V3's q_b_proj, 1536 -> 24576: 1.10x)
ALIGN = 16  # both sides of an FP8 GEMM operand (torch._scaled_mm)
EXPERTS_FASTER = False  # the experts' FP8 grouped GEMM, measured slower than bf16 (module docstring)


def capability(gpu: GPU) -> tuple[int, int] | None:
    if gpu.compute_capability is None:
        return None
    major, minor = gpu.compute_capability.split(".")
    return int(major), int(minor)


def unmet(gpu: GPU) -> str | None:
    """Why `gpu` cannot train in FP8, or None if it can."""
    if gpu.peak_tflops_fp8 is None:
        return "has no FP8 tensor cores"
    cc = capability(gpu)
    if cc is None or cc < FP8_MIN_CAPABILITY:
        return (
            f"(compute capability {gpu.compute_capability}) has FP8 tensor cores but no FP8 grouped GEMM "
            "for the routed experts (torch._scaled_grouped_mm needs 9.0)"
        )
    return None


def recipe(asked: str, gpu: GPU, precision: str) -> str | None:
    """The recipe the trainer runs, None for bf16; SpecError where the GPU or the precision cannot."""
    if asked == "off":
        return None
    why = unmet(gpu)
    if why is not None:
        raise fp8_compute_unsupported(gpu.name, why)
    if precision != "bf16":
        raise SpecError("training.fp8", f"runs over bf16 weights; this plan's precision is {precision}")
    return FASTEST if asked == "on" else asked


def linear_sides(s: ModelShape) -> dict[str, tuple[int, int]]:
    """Every linear of a decoder layer by role (its name within the layer, as transformers' DeepSeek
    models name it), with its (in, out) features. The output head and the router are not here: they stay
    bf16 whatever their size."""
    q, v = s.head_dims
    sides: dict[str, tuple[int, int]] = {}
    if s.mla:
        if s.q_lora_rank:
            sides["self_attn.q_a_proj"] = (s.hidden, s.q_lora_rank)
            sides["self_attn.q_b_proj"] = (s.q_lora_rank, s.heads * q)
        else:
            sides["self_attn.q_proj"] = (s.hidden, s.heads * q)
        sides["self_attn.kv_a_proj_with_mqa"] = (s.hidden, s.kv_lora_rank + s.qk_rope_head_dim)
        sides["self_attn.kv_b_proj"] = (s.kv_lora_rank, s.heads * (s.qk_nope_head_dim + v))
    else:
        for p in ("q_proj", "k_proj", "v_proj"):
            sides[f"self_attn.{p}"] = (s.hidden, s.heads * q)
    sides["self_attn.o_proj"] = (s.heads * v, s.hidden)
    if s.dense_layers:
        for p in ("gate_proj", "up_proj"):
            sides[f"mlp.{p}"] = (s.hidden, s.dense_intermediate)
        sides["mlp.down_proj"] = (s.dense_intermediate, s.hidden)
    if s.shared_experts and s.moe_layers:
        width = s.expert_intermediate * s.shared_experts
        for p in ("gate_proj", "up_proj"):
            sides[f"mlp.shared_experts.{p}"] = (s.hidden, width)
        sides["mlp.shared_experts.down_proj"] = (width, s.hidden)
    return sides


def pays(sides: tuple[int, int]) -> bool:
    """A linear measured (or as large as one measured) faster in FP8 than in bf16."""
    i, o = sides
    return i * o >= MIN_ELEMENTS and min(i, o) >= MIN_SIDE and not (i % ALIGN or o % ALIGN)


def linear_roles(s: ModelShape) -> list[str]:
    """The roles the trainer converts: those that pay."""
    return [r for r, sides in linear_sides(s).items() if pays(sides)]


def experts(asked: str, s: ModelShape) -> bool:
    """The routed experts in FP8: `overrides.fp8_experts` on, or auto where measured faster (nowhere yet)."""
    if asked == "on" and (s.hidden % ALIGN or s.expert_intermediate % ALIGN):
        raise SpecError(
            "overrides.fp8_experts",
            f"on needs the experts' sides to be multiples of {ALIGN} "
            f"({s.hidden} x {s.expert_intermediate} here); one of: auto, off",
        )
    return asked == "on" or (asked == "auto" and EXPERTS_FASTER)
