"""Whether and where a run computes in FP8 (`training.fp8`): the user's choice, since it changes the
numerics; the plan checks the GPU can, names the recipe, and decides which products go FP8 from measurements
(the trainer converts them: dskit/train/fp8/compute.py).

Measured on one H100 with torchao 0.18 and torch 2.11 by bench/fp8_gemm_bench.py (bench/results/training/
h100-fp8-gemm-v3-2026-12-05.json and h100-fp8-gemm-v2-lite-2026-12-05.json), each product forward + backward
at 8,192 tokens a micro-step, against the bf16 linear as the trainer runs it (eager):
- a linear in FP8 pays only compiled, and only large: tensorwise 1.10-1.58x bf16 from V3's q_b_proj
  (1536 x 24576) up (o_proj, the dense MLP); below that it loses (V3's shared experts, 7168 x 2048: 0.82-0.85x;
  MLA's kv_a 0.46x, kv_b 0.68x; every V2-Lite linear, its 2048 x 10944 dense MLP included: 1.00x together).
  Rowwise pays less (1.13-1.28x on o_proj and the dense MLP, 0.89x on q_b_proj) and its loss stays closer
  to bf16's (docs/trainer.md "FP8 training").
- the routed experts' FP8 grouped GEMM loses at both widths (0.65x V2-Lite, 0.88x V3): they stay bf16
  unless `overrides.fp8_experts=on`.
"""

from __future__ import annotations

from dskit.catalog import GPU
from dskit.errors import SpecError
from dskit.plan.candidate import Fp8Compute
from dskit.plan.shape import ModelShape
from dskit.refusals import FP8_MIN_CAPABILITY, fp8_compute_unsupported

FASTEST = "tensorwise"  # what `on` resolves to: the faster recipe in every row measured faster than bf16
#: the smallest linear (in x out) measured faster in FP8 than in bf16, per recipe: tensorwise V3's q_b_proj
#: (1536 x 24576, 1.10x), rowwise V3's o_proj (16384 x 7168, 1.22x; its q_b_proj ran 0.89x)
MIN_ELEMENTS = {"tensorwise": 2**25, "rowwise": 16384 * 7168}
MIN_SIDE = 1536  # the shortest side measured faster (q_b_proj's 1536); MLA's kv_b (512 in) ran 0.55-0.71x
ALIGN = 16  # both sides of an FP8 GEMM operand (torch._scaled_mm)
#: the converted linears' time in bf16 (eager, as the trainer runs them) over FP8 (compiled), at V3's widths
LINEAR_SPEEDUP = {"tensorwise": 1.48, "rowwise": 1.22}
#: the routed experts' FP8 grouped GEMM over bf16's: measured slower (0.65x at V2-Lite's widths)
EXPERTS_SPEEDUP = 0.88
EXPERTS_FASTER = EXPERTS_SPEEDUP > 1  # what `overrides.fp8_experts: auto` decides


def unmet(gpu: GPU) -> str | None:
    """Why `gpu` cannot train in FP8, or None if it can."""
    if gpu.peak_tflops_fp8 is None:
        return "has no FP8 tensor cores"
    if gpu.capability is None or gpu.capability < FP8_MIN_CAPABILITY:
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


def pays(sides: tuple[int, int], recipe: str) -> bool:
    """A linear as large as one measured faster in FP8 with `recipe` than in bf16."""
    i, o = sides
    return i * o >= MIN_ELEMENTS[recipe] and min(i, o) >= MIN_SIDE and not (i % ALIGN or o % ALIGN)


def linear_roles(s: ModelShape, recipe: str) -> list[str]:
    """The roles the trainer converts: those that pay."""
    return [r for r, sides in linear_sides(s).items() if pays(sides, recipe)]


def experts(asked: str, s: ModelShape) -> bool:
    """The routed experts in FP8: `overrides.fp8_experts` on, or auto where measured faster (nowhere yet)."""
    if asked == "on" and (s.hidden % ALIGN or s.expert_intermediate % ALIGN):
        raise SpecError(
            "overrides.fp8_experts",
            f"on needs the experts' sides to be multiples of {ALIGN} "
            f"({s.hidden} x {s.expert_intermediate} here); one of: auto, off",
        )
    return asked == "on" or (asked == "auto" and EXPERTS_FASTER)


def _layers_with(s: ModelShape, role: str) -> int:
    if role.startswith("mlp.shared_experts."):
        return s.moe_layers
    return s.dense_layers if role.startswith("mlp.") else s.layers


def compute(recipe: str, roles: list[str], with_experts: bool, s: ModelShape) -> Fp8Compute:
    """What the FP8 products weigh in the step-time model: 6 FLOPs a weight a token (forward, both
    backward products) at their measured speed-ups."""
    sides = linear_sides(s)
    linear = sum(6 * sides[r][0] * sides[r][1] * _layers_with(s, r) for r in roles)
    routed = 6 * 3 * s.hidden * s.expert_intermediate * s.active_experts * s.moe_layers if with_experts else 0
    return Fp8Compute(linear, LINEAR_SPEEDUP[recipe], routed, EXPERTS_SPEEDUP)
