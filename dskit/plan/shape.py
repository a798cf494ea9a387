"""The model's shape: every dimension the planner computes with, typed and frozen.

A DeepSeek MoE is described by its config.json (a catalog entry's `config`, or a local checkpoint's
file: dskit/catalog/__init__.py checks its keys and values). `ModelShape.from_config` reads that dict
once, here and nowhere else; the parameter and FLOP counts (`model_math.py`), the memory and step-time
models, LoRA's counts and the calibration job take the shape. The dict itself still travels into
run.yaml unchanged (`ModelPlan.config`): the trainer builds the model from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    vocab: int  # vocab_size
    hidden: int  # hidden_size
    layers: int  # num_hidden_layers (after model.num_layers truncated them)
    dense_layers: int  # the first layers, with a dense MLP: first_k_dense_replace, at most `layers`
    heads: int  # num_attention_heads
    dense_intermediate: int  # intermediate_size: a dense layer's MLP width
    expert_intermediate: int  # moe_intermediate_size: one routed or shared expert's MLP width
    routed_experts: int  # n_routed_experts per MoE layer
    active_experts: int  # num_experts_per_tok: the routed experts each token goes to (top-k)
    shared_experts: int  # n_shared_experts per MoE layer (0: none)
    kv_lora_rank: int  # MLA's compressed key/value width (0: plain multi-head attention)
    q_lora_rank: int  # MLA's compressed query width (0: queries projected from the hidden state)
    qk_nope_head_dim: int  # MLA only (0 otherwise)
    qk_rope_head_dim: int  # MLA only (0 otherwise)
    v_head_dim: int  # MLA only (0 otherwise)
    tied_embeddings: bool  # tie_word_embeddings: the lm_head shares the embedding's weights
    max_positions: int | None  # max_position_embeddings (None: the config states none)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """The shape of a config.json's content, as dskit/catalog/__init__.py `check_config` accepts it."""
        layers = cfg["num_hidden_layers"]
        return cls(
            vocab=cfg["vocab_size"],
            hidden=cfg["hidden_size"],
            layers=layers,
            dense_layers=min(cfg.get("first_k_dense_replace") or 0, layers),
            heads=cfg["num_attention_heads"],
            dense_intermediate=cfg["intermediate_size"],
            expert_intermediate=cfg["moe_intermediate_size"],
            routed_experts=cfg["n_routed_experts"],
            active_experts=cfg["num_experts_per_tok"],
            shared_experts=cfg.get("n_shared_experts") or 0,
            kv_lora_rank=cfg.get("kv_lora_rank") or 0,
            q_lora_rank=cfg.get("q_lora_rank") or 0,
            qk_nope_head_dim=cfg.get("qk_nope_head_dim") or 0,
            qk_rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
            v_head_dim=cfg.get("v_head_dim") or 0,
            tied_embeddings=bool(cfg.get("tie_word_embeddings")),
            max_positions=cfg.get("max_position_embeddings"),
        )

    @property
    def moe_layers(self) -> int:
        """The layers after the dense ones, each with routed experts."""
        return self.layers - self.dense_layers

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2 and V3); plain multi-head attention otherwise
        (deepseek-moe-16b)."""
        return bool(self.kv_lora_rank)

    @property
    def head_dims(self) -> tuple[int, int]:
        """(q/k head dim, v head dim). MLA: nope + rope and v_head_dim; MHA: hidden / heads."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        d = self.hidden // self.heads
        return d, d
