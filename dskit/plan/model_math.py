"""Parameter and FLOP counts of a DeepSeek MoE's shape (`shape.py`), without building the model.

One place for this arithmetic: the planner's memory model and the trainer's MFU both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dskit.plan.shape import ModelShape


@dataclass(frozen=True)
class ModelCounts:
    total: int  # all parameters
    active: int  # parameters touched per token, excluding the embedding lookup (for 6*N FLOPs)
    largest_layer: int  # largest decoder layer's non-expert parameters (ZeRO-3 gathers one at a time)
    experts_per_layer: int  # routed-expert parameters of one MoE layer (0 if no MoE layer)
    moe_layer_non_expert: int  # a MoE layer's attention, norms, shared experts and router (0 if none)
    largest_module: int  # largest single module: one MoE layer's routed experts, the embedding, an MLP
    attn_flops_per_token: float  # causal attention score/value FLOPs per token, forward + backward
    dense_layers: int  # ModelShape.dense_layers, beside the counts they split
    moe_layers: int  # ModelShape.moe_layers


def attention_params(s: ModelShape) -> int:
    h, nh = s.hidden, s.heads
    if not s.mla:  # plain multi-head attention (deepseek-moe-16b)
        return 4 * h * h
    dqk, dv = s.head_dims
    rope, kvl, ql = s.qk_rope_head_dim, s.kv_lora_rank, s.q_lora_rank
    q = h * ql + ql + ql * nh * dqk if ql else h * nh * dqk
    kv = h * (kvl + rope) + kvl + kvl * nh * (s.qk_nope_head_dim + dv)
    return q + kv + nh * dv * h


def counts(s: ModelShape, seq_len: int) -> ModelCounts:
    h, V, L = s.hidden, s.vocab, s.layers
    E, mi, k = s.routed_experts, s.expert_intermediate, s.active_experts
    shared = s.shared_experts
    dense_layers, moe_layers = s.dense_layers, s.moe_layers
    attn = attention_params(s) + 2 * h  # + the two RMSNorms
    dense_mlp = 3 * h * s.dense_intermediate
    routed = E * 3 * h * mi
    moe_non_expert = 3 * h * mi * shared + E * h  # shared experts + router
    embed = V * h * (1 if s.tied_embeddings else 2)
    total = L * attn + dense_layers * dense_mlp + moe_layers * (routed + moe_non_expert) + embed + h
    active = (
        L * attn
        + dense_layers * dense_mlp
        + moe_layers * (3 * h * mi * (k + shared) + E * h)
        + V * h  # lm_head
    )
    dqk, dv = s.head_dims
    # causal: half the s x s scores; QK^T and PV are 2*(dqk+dv) FLOPs per (query, key); x3 for fwd+bwd
    attn_flops = L * s.heads * 2 * (dqk + dv) * seq_len / 2 * 3
    largest = max(attn + (dense_mlp if dense_layers else moe_non_expert), embed // 2)
    experts_per_layer = routed if moe_layers else 0
    # transformers stores a MoE layer's routed experts as one module (fused gate_up/down tensors), so
    # partitioned construction gathers all of them at once; the embedding and lm_head are V x h each.
    largest_module = max(experts_per_layer, V * h, dense_mlp if dense_layers else 0, attention_params(s))
    return ModelCounts(
        total=total,
        active=active,
        largest_layer=largest,
        experts_per_layer=experts_per_layer,
        moe_layer_non_expert=attn + moe_non_expert if moe_layers else 0,
        largest_module=largest_module,
        attn_flops_per_token=attn_flops,
        dense_layers=dense_layers,
        moe_layers=moe_layers,
    )


def tensor_sizes(s: ModelShape) -> dict[str, list[int]]:
    """Element counts of each parameter tensor, by where it lives: `dense_layer` (one dense decoder
    layer), `moe_layer` (one MoE layer's attention, norms, shared experts and router), `experts` (one
    MoE layer's routed experts, as transformers fuses them: gate_up and down, all experts in each) and
    `outer` (embedding, lm_head, final norm). ZeRO-3 never gathers a tensor at or below its
    persistence threshold (it stays whole on every rank): `gathered`."""
    h, V = s.hidden, s.vocab
    E, mi = s.routed_experts, s.expert_intermediate
    nh = s.heads
    if s.mla:
        dqk, dv = s.head_dims
        rope, kvl, ql = s.qk_rope_head_dim, s.kv_lora_rank, s.q_lora_rank
        q = [h * ql, ql, ql * nh * dqk] if ql else [h * nh * dqk]
        attn = [*q, h * (kvl + rope), kvl, kvl * nh * (s.qk_nope_head_dim + dv), nh * dv * h]
    else:
        attn = [h * h] * 4
    norms = [h, h]
    shared = [h * mi * s.shared_experts] * 3 if s.shared_experts else []
    outer = [V * h, h] + ([] if s.tied_embeddings else [V * h])
    return {
        "dense_layer": [*attn, *norms, *[h * s.dense_intermediate] * 3],
        "moe_layer": [*attn, *norms, *shared, E * h],
        "experts": [E * 2 * mi * h, E * h * mi],
        "outer": outer,
    }


def gathered(sizes: list[int], persistence_threshold: int) -> int:
    """Elements ZeRO-3 gathers of these tensors: those above the threshold (DeepSpeed's
    `stage3_param_persistence_threshold`: a tensor of at most that many elements is kept whole on every
    rank, parameter_offload.py's `ds_numel <= param_threshold`)."""
    return sum(n for n in sizes if n > persistence_threshold)


def flops_per_token(c: ModelCounts) -> float:
    """Training FLOPs per token: 6 x active params (fwd 2, bwd 4; Kaplan et al. 2020) + attention."""
    return 6 * c.active + c.attn_flops_per_token
