"""LoRA on a frozen base: which modules get adapters, and what trains (T) against what is frozen (F).

The memory and step-time models (memory.py, speed.py, host.py) read a `Tuning`; the trainer reads the
regexes this module decides (`FinetunePlan.target_modules`, handed to peft's `LoraConfig`) and checks
that peft's injected parameters add up to `FinetunePlan.adapter_params`, so the plan's count and the
trainer's cannot drift apart.

Counts (per decoder layer; h hidden, r rank): every adapted nn.Linear(in, out) adds A [r, in] and
B [out, r], r * (in + out) parameters (Hu et al. 2021, LoRA). The router (`targets: router`) is trained
whole, E x h per MoE layer: it is not an nn.Linear in transformers and it is tiny.

Routed experts (`targets: routed_experts`, dskit/train/lora/routed.py): an adapter per expert and
projection (gate, up, down), r * (in + out) each: 3 r (h + I) per expert, all E experts of every MoE layer counted (each rank holds 1/ep of them, as of the experts). They are applied
as a weight delta W + (alpha / r) B A, which costs what a frozen expert saves: the weight-gradient
GEMM (2 FLOPs per active routed weight per token) and, per micro-step, 6 r in out per local expert
and projection to form B A and its gradients; and the bf16 W_eff of a layer's local experts is held
for backward by every layer that is not checkpointed, its gradient while the layer's backward runs.

FP8 (`base_precision: fp8`, DeepSeek-V3's format): every frozen linear weight is e4m3 (1 byte) plus one
fp32 scale per 128 x 128 block (4 / 128^2 bytes per weight); the embedding, lm_head, norms and router
stay bf16, as in DeepSeek's published checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

from dskit.errors import SpecError
from dskit.plan.model_math import ModelCounts
from dskit.plan.schema import FinetunePlan
from dskit.plan.shape import ModelShape
from dskit.refusals import no_fp8_checkpoint
from dskit.spec.finetune import FinetuneSpec

#: DeepSeek-V3's FP8 block (config.json quantization_config weight_block_size [128, 128])
FP8_BLOCK = 128
FP8_BYTES = 1 + 4 / FP8_BLOCK**2  # e4m3 weight + its share of the block's fp32 scale_inv
BF16_BYTES = 2
#: dequantising one FP8 weight (dskit/train/fp8/blocks.py `dequantize_blocks`): two float32 copies (the padded
#: blocks, the product) and the bf16 result, per weight element
DEQUANT_PEAK_BYTES = 2 * 4 + BF16_BYTES

# peft's target_modules as one regex (fullmatch on module names, before AutoEP replaces the MoE blocks:
# the names are transformers'). A MoE layer's `mlp` has no gate_proj of its own (its `gate` is the
# router), so `mlp.(gate|up|down)_proj` matches the dense layers' MLP only.
_ATTENTION = r"self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|k_proj|v_proj|o_proj)"
TARGET_REGEX = {
    "attention": _ATTENTION,
    "shared_experts": r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)",
    "dense_mlp": r"mlp\.(gate_proj|up_proj|down_proj)",
}
#: the router's trained parameter (transformers' name; AutoEP moves it to mlp.router.gate.weight)
ROUTER_PARAM = r"model\.layers\.\d+\.mlp\.gate\.weight"


def target_modules(targets: list[str]) -> str | None:
    """The regex peft matches module names against (None: no linear is adapted, e.g. router only)."""
    parts = [TARGET_REGEX[t] for t in targets if t in TARGET_REGEX]
    return rf"model\.layers\.\d+\.({'|'.join(parts)})" if parts else None


def _attention_linears(s: ModelShape) -> list[tuple[int, int]]:
    h, nh = s.hidden, s.heads
    if not s.mla:
        return [(h, h)] * 4
    dqk, dv = s.head_dims
    kvl, ql, rope = s.kv_lora_rank, s.q_lora_rank, s.qk_rope_head_dim
    q = [(h, ql), (ql, nh * dqk)] if ql else [(h, nh * dqk)]
    return q + [(h, kvl + rope), (kvl, nh * (s.qk_nope_head_dim + dv)), (nh * dv, h)]


def _mlp_linears(h: int, inter: int) -> list[tuple[int, int]]:
    return [(h, inter), (h, inter), (inter, h)]


def routed_adapters_per_layer(s: ModelShape, r: int) -> int:
    """A MoE layer's routed adapters, all experts: gate and up (h -> I) and down (I -> h) per expert."""
    return s.routed_experts * r * sum(i + o for i, o in _mlp_linears(s.hidden, s.expert_intermediate))


def adapted_linears(s: ModelShape, targets: list[str], layer: int) -> list[tuple[int, int]]:
    """(in, out) of every linear of decoder layer `layer` that gets an adapter."""
    h = s.hidden
    dense = layer < s.dense_layers
    out = list(_attention_linears(s)) if "attention" in targets else []
    if dense and "dense_mlp" in targets:
        out += _mlp_linears(h, s.dense_intermediate)
    shared = s.shared_experts
    if not dense and shared and "shared_experts" in targets:
        out += _mlp_linears(h, shared * s.expert_intermediate)
    return out


@dataclass(frozen=True)
class Tuning:
    """What a LoRA run trains and holds: the memory and step-time models' inputs besides ModelCounts."""

    adapters: int  # LoRA A and B parameters (the routed experts' among them)
    routed_adapters: int  # of which on the routed experts: EP-sharded like the experts, applied as a delta
    router: int  # router weights trained whole (0 unless targeted)
    frozen_experts: int  # routed-expert parameters (frozen; AutoEP gives each rank 1/ep of them)
    frozen_other: int  # every other frozen parameter
    expert_bytes: float  # bytes per frozen routed-expert weight on the GPU
    other_bytes: float  # bytes per other frozen parameter (averaged: fp8 linears, bf16 embedding/norms)
    largest_layer_trainable: int  # a decoder layer's trainable parameters (ZeRO-3 gradient buckets)
    activation_bytes: tuple[int, ...]  # per token, per decoder layer: what the adapters keep for backward
    # per token, per decoder layer: what its frozen GEMMs do not keep while the layer waits for backward
    frozen_unkept: tuple[int, ...]
    dequant_bytes: int  # fp8: the largest linear being dequantised (fp32 blocks + bf16 result); 0 for bf16
    active_routed: int = 0  # routed-expert weights a token passes through when they carry a delta (else 0)
    routed_delta_bytes: int = 0  # bf16 bytes of one MoE layer's W_eff, all experts (a rank holds 1/ep)
    # fp8: one MoE layer's routed experts being dequantised (all E; the trainer holds E / ep): w1, w2, w3
    # in bf16, the last one also in its two float32 copies
    expert_dequant_bytes: int = 0
    fp8_linears: int = 0  # fp8: the non-expert linear weights held in FP8 (dequantised every pass)

    @property
    def fp8(self) -> bool:
        """The frozen base is held in FP8 (the trainer's ZeRO-1/2 path only: dskit/train/fp8/frozen_base.py)."""
        return self.dequant_bytes > 0

    @property
    def trainable(self) -> int:
        return self.adapters + self.router

    @property
    def frozen(self) -> int:
        return self.frozen_experts + self.frozen_other

    def trainable_local(self, ep_size: int) -> float:
        """Trainable parameters a rank holds whole (ZeRO-1/2): all but the routed adapters, 1/ep of those."""
        return self.trainable - self.routed_adapters + self.routed_adapters / ep_size

    def frozen_weight_bytes(self, ep_size: int) -> float:
        """Frozen bytes a rank holds whole (ZeRO-1/2): the non-expert base and 1/ep of the experts."""
        return self.other_bytes * self.frozen_other + self.expert_bytes * self.frozen_experts / ep_size

    def fp8_weights_local(self, ep_size: int) -> float:
        """FP8 weights a rank dequantises in each forward and each backward: its FP8 linears and 1/ep of
        the routed experts (0 for a bf16 base)."""
        return self.fp8_linears + self.frozen_experts / ep_size if self.fp8 else 0.0

    def flops_per_token(self, c: ModelCounts) -> float:
        """Training FLOPs per token: forward 2 and input-gradient 2 per active base weight, no weight-
        gradient GEMM for the frozen ones (the 2/3 of a full backward that remains); 6 per trainable one
        (adapters and router); attention's score/value FLOPs as in full training. Routed experts with a
        delta run their weight-gradient GEMM again (2 per active routed weight); forming B A per
        micro-step (6 r in out per local expert and projection) depends on the tokens per micro-step
        and is left out: for DeepSeek-V3 at r 16, EP 8 and 4096 tokens it is ~1 % of the step."""
        return 4 * c.active + 2 * self.active_routed + 6 * self.trainable_active(c) + c.attn_flops_per_token

    def trainable_active(self, c: ModelCounts) -> int:
        """Trainable parameters touched per token: every adapter but the routed ones (those enter
        through the weight, counted in `active_routed`), and every router weight (scoring reads all E
        rows)."""
        return self.adapters - self.routed_adapters + self.router

    def forward_share(self, c: ModelCounts) -> float:
        """Share of a step's FLOPs that a recomputed forward repeats (a third in full training)."""
        fwd = 2 * (c.active + self.trainable_active(c)) + c.attn_flops_per_token / 3
        return fwd / self.flops_per_token(c)


def _fp8_linear_params(s: ModelShape, c: ModelCounts) -> int:
    """Non-expert parameters stored in FP8 by DeepSeek-V3's format: every linear but the router,
    embedding and lm_head (those, and the norms, stay bf16)."""
    h, L = s.hidden, s.layers
    attn = sum(i * o for i, o in _attention_linears(s))
    dense = 3 * h * s.dense_intermediate * c.dense_layers
    shared = 3 * h * s.shared_experts * s.expert_intermediate * c.moe_layers
    return L * attn + dense + shared


def _frozen_unkept(s: ModelShape, targets: list[str], *, dense: bool) -> int:
    """Activation bytes per token that a stored layer's frozen routed experts do not keep: a GEMM saves
    its input only for its weight's gradient, so a frozen expert drops its dispatched input (h per
    routed copy) and the SwiGLU product that feeds w2; and of the three moe_intermediate-wide tensors
    per copy that full training's count holds, AutoEP's fused SwiGLU on GPUs keeps two, gate and up
    (DeepSpeed's Triton swiglu recomputes the SiLU; in full training that surplus sits inside the fitted
    ACTIVATION_SLACK). The combine's inputs stay: the router's weights still need a gradient through
    the hidden state that the adapters below train. Attention, shared experts and a dense MLP are
    counted whole: a frozen dense MLP's saving did not show on the runs whose dense layer was stored.
    Only a stored layer saves this: the peak of a recomputed layer's backward holds gradient
    temporaries of the same size. Measured on one H200 (bench/results/lora/h200-lora-cal-2026-12-02.json,
    h200-lora-2026-12-02.json, h200-lora-pick-2026-12-02.json): with this the plan is within -5..+4%
    of peak reserved on every LoRA run, which it overestimated by up to 44% counted as full training;
    counted on recomputed layers too, it fell 16% short on a checkpointed one."""
    if dense or "routed_experts" in targets:
        return 0
    return BF16_BYTES * s.active_experts * (s.hidden + 2 * s.expert_intermediate)


def tuning(
    s: ModelShape, c: ModelCounts, *, targets: list[str], r: int, dropout: float, base_precision: str
) -> Tuning:
    L, h = s.layers, s.hidden
    per_layer = [adapted_linears(s, targets, i) for i in range(L)]
    routed = routed_adapters_per_layer(s, r) if "routed_experts" in targets else 0
    adapters = [
        r * sum(i + o for i, o in lin) + routed * (i >= c.dense_layers) for i, lin in enumerate(per_layer)
    ]
    router_per_layer = s.routed_experts * h if "router" in targets else 0
    routers = [router_per_layer * (i >= c.dense_layers) for i in range(L)]
    experts = c.experts_per_layer * c.moe_layers
    fp8 = base_precision == "fp8"
    frozen_other = c.total - experts - sum(routers)
    fp8_params = _fp8_linear_params(s, c) if fp8 else 0
    other_bytes = (FP8_BYTES * fp8_params + BF16_BYTES * (frozen_other - fp8_params)) / frozen_other
    # per token: B's input (the r-wide output of A) for every adapted linear; with dropout, A's input
    # is the dropped copy of x (bf16) and its mask (1 byte) rather than the x the base linear keeps anyway
    kept = [sum(2 * r + (3 * i if dropout else 0) for i, _ in lin) for lin in per_layer]
    shared = s.shared_experts * s.expert_intermediate
    dense = s.dense_intermediate if c.dense_layers else 0
    unkept = tuple(_frozen_unkept(s, targets, dense=i < c.dense_layers) for i in range(L))
    largest_linear = max([i * o for i, o in _attention_linears(s)] + [h * dense, h * shared])
    routed_on = routed > 0
    active_experts = s.active_experts * 3 * h * s.expert_intermediate * c.moe_layers
    return Tuning(
        adapters=sum(adapters),
        routed_adapters=routed * c.moe_layers,
        active_routed=active_experts if routed_on else 0,
        routed_delta_bytes=BF16_BYTES * c.experts_per_layer if routed_on else 0,
        router=sum(routers),
        frozen_experts=experts,
        frozen_other=frozen_other,
        expert_bytes=FP8_BYTES if fp8 else BF16_BYTES,
        other_bytes=other_bytes,
        largest_layer_trainable=max(a + b for a, b in zip(adapters, routers, strict=True)),
        activation_bytes=tuple(kept),
        frozen_unkept=unkept,
        dequant_bytes=DEQUANT_PEAK_BYTES * largest_linear if fp8 else 0,
        expert_dequant_bytes=int((BF16_BYTES + 8 / 3) * c.experts_per_layer) if fp8 else 0,
        fp8_linears=fp8_params,
    )


def base_precision(f: FinetuneSpec, path: str | None) -> str:
    """`finetune.base_precision` resolved: auto is fp8 where model.path holds DeepSeek-V3's FP8 format
    and the base is frozen (LoRA), else bf16. fp8 from a checkpoint without FP8 weights is refused:
    the trainer keeps the checkpoint's own FP8 bytes and does not quantise a bf16 base."""
    from dskit.formats.hf_checkpoint import fp8_format

    fp8_checkpoint = path is not None and fp8_format(path) is not None
    if f.base_precision == "auto":
        return "fp8" if f.method == "lora" and fp8_checkpoint else "bf16"
    if f.base_precision == "fp8" and path is not None and not fp8_checkpoint:
        raise no_fp8_checkpoint(path)
    return f.base_precision


def plan_finetune(
    f: FinetuneSpec, s: ModelShape, c: ModelCounts, path: str | None = None
) -> tuple[FinetunePlan | None, Tuning | None]:
    """The plan's finetune section and the models' view of it; (None, None) for full fine-tuning.
    `path`: model.path, whose format decides `base_precision: auto`."""
    if f.method == "full":
        base_precision(f, path)  # checks an explicit fp8 against the checkpoint
        return None, None
    lo = f.lora
    precision = base_precision(f, path)
    t = tuning(s, c, targets=lo.targets, r=lo.r, dropout=lo.dropout, base_precision=precision)
    if t.trainable == 0:  # e.g. dense_mlp alone on a model whose layers are all MoE
        raise SpecError(
            "finetune.lora.targets",
            f"{', '.join(lo.targets)} match no module of this model (no dense layer: first_k_dense_replace "
            f"{s.dense_layers}; no shared experts: n_shared_experts {s.shared_experts}); add attention or "
            "shared_experts",
        )
    plan = FinetunePlan(
        method="lora",
        base_precision=precision,
        r=lo.r,
        alpha=lo.alpha,
        dropout=lo.dropout,
        targets=list(lo.targets),
        target_modules=target_modules(lo.targets) if t.adapters > t.routed_adapters else None,
        whole_params=ROUTER_PARAM if "router" in lo.targets else None,
        adapter_params=t.adapters,
        routed_adapter_params=t.routed_adapters,
        trainable_params=t.trainable,
        frozen_params=t.frozen,
    )
    return plan, t
