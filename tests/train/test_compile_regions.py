"""What the regional compile routes is what the planner counts (`memory.compiled_saving_per_token_layer`):
every RMSNorm (two per layer, the KV and Q latent norms where the model has them, the final one) and the
SwiGLU of every dense layer and every MoE layer's shared experts, for both DeepSeek architectures."""

from __future__ import annotations

import pytest

from dskit import catalog


@pytest.mark.parametrize("preset", ["tiny-v2", "tiny-v3"])
def test_every_norm_and_shared_swiglu_is_routed(preset, monkeypatch):
    import transformers.models.deepseek_v2.modeling_deepseek_v2 as v2
    from transformers import AutoModelForCausalLM

    # compile_regions rebinds the module's rotary function: undone after the test, so other tests in this
    # process keep eager V2 (on CPU a compiled one would pay inductor's C++ build)
    monkeypatch.setattr(v2, "apply_rotary_emb", v2.apply_rotary_emb)

    from dskit.train.compile import compile_regions
    from dskit.train.model import hf_config

    cfg = dict(catalog.model(preset).config)
    model = AutoModelForCausalLM.from_config(hf_config(cfg, "sdpa"))
    done = compile_regions(model)
    layers, dense = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace") or 0
    norms_per_layer = 2 + bool(cfg.get("kv_lora_rank")) + bool(cfg.get("q_lora_rank"))
    assert done["rms_norm"] == layers * norms_per_layer + 1
    assert done["swiglu_mlp"] == dense + (layers - dense) * bool(cfg.get("n_shared_experts"))
    # V2 computes rotary through complex tensors (compiled in real arithmetic); V3's stays eager and the
    # planner counts no saving for it
    assert done["rotary"] == (cfg["model_type"] == "deepseek_v2")
