"""Catalog integrity: every entry complete and sourced, model presets matching their published sizes."""

from __future__ import annotations

import pytest

from dskit import catalog
from dskit.errors import SpecError
from dskit.plan.model_math import counts
from dskit.plan.shape import ModelShape

REQUIRED_GPUS = {
    "a100-40gb",
    "a100-80gb",
    "h100-80gb",
    "h200-141gb",
    "rtx4090-24gb",
    "rtx6000ada-48gb",
    "l40s-48gb",
    "v100-32gb",
    "cpu",
}
REQUIRED_MODELS = {
    "deepseek-v2-lite",
    "deepseek-v2",
    "deepseek-v3",
    "deepseek-moe-16b",
    "deepseek-coder-v2-lite",
    "tiny-v2",
    "tiny-v3",
}


def test_catalogs_cover_the_required_entries():
    assert REQUIRED_GPUS <= set(catalog.gpus())
    assert REQUIRED_MODELS <= set(catalog.models())
    assert {"infiniband", "roce", "efa", "tcp"} <= set(catalog.fabrics())


@pytest.mark.parametrize("gpu", sorted(catalog.gpus().values(), key=lambda g: g.name), ids=lambda g: g.name)
def test_gpu_entries_are_consistent(gpu):
    assert gpu.source
    assert gpu.flash_attn in {"fa2", "fa4", "none"}
    assert gpu.attention in {"sdpa", "sdpa_cudnn", "flash_attention_2", "flash_attention_4"}
    assert gpu.attention in gpu.attention_backends  # `auto` picks something the GPU can run
    if gpu.is_cpu:
        assert gpu.peak_tflops_bf16 is None  # no MFU rather than a wrong one
        return
    major = int(gpu.compute_capability.split(".")[0])
    assert gpu.bf16 == (major >= 8)  # bf16 tensor cores arrived with Ampere
    assert (gpu.flash_attn == "fa4") == (major == 9)
    assert (gpu.flash_attn == "none") == (major < 8)
    assert gpu.peak_tflops_fp16 and gpu.memory_gib and gpu.memory_bw_gbs


def test_cudnn_attention_is_allowed_only_where_the_image_has_cudnn_9_11():
    """sdpa_cudnn on MLA's 192/128 dims needs cuDNN >= 9.11: the cu130 image's torch ships 9.19."""
    from dskit.render.image import toolchain_for, toolchains

    for gpu in catalog.gpus().values():
        if "sdpa_cudnn" in gpu.attention_backends:
            assert toolchain_for(gpu) == "cu130" and "cuDNN 9.19" in toolchains()["cu130"]["checked"]


@pytest.mark.parametrize("gpu", sorted(catalog.gpus().values(), key=lambda g: g.name), ids=lambda g: g.name)
def test_gpu_memory_is_usable_not_datasheet_and_sourced(gpu):
    """usable < datasheet (ECC, driver and firmware reserve), within the 0.92 floor gpus.yaml states."""
    assert gpu.usable_memory_source and gpu.host_memory_source
    if gpu.is_cpu:
        assert gpu.usable_memory_gib is None and gpu.host_memory_gib_per_gpu is None  # unknown, not guessed
        return
    assert 0.92 * gpu.memory_gib <= gpu.usable_memory_gib < gpu.memory_gib
    assert gpu.host_memory_gib_per_gpu >= gpu.memory_gib  # every reference node has more RAM than HBM
    if gpu.host_memory_source.startswith("derived"):  # the header's rule: 2 x datasheet GPU memory
        assert gpu.host_memory_gib_per_gpu == 2 * gpu.memory_gib


def test_h200_usable_memory_is_the_reading():
    h200 = catalog.gpu("h200-141gb")
    assert h200.usable_memory_gib == pytest.approx(150109880320 / 2**30, abs=0.01)
    assert catalog.gpu("h100-80gb").usable_memory_gib == pytest.approx(79.1, abs=0.05)


def test_fabric_env_values_are_strings():
    for f in catalog.fabrics().values():
        assert f.source and all(isinstance(v, str) for v in f.env.values())
        assert f.rdma == (f.name != "tcp")


# Published totals / active parameters (papers and model cards), in billions.
PUBLISHED = {
    "deepseek-v2-lite": (15.7, 2.4),
    "deepseek-v2": (236, 21),
    "deepseek-v3": (671, 37),
    "deepseek-moe-16b": (16.4, 2.8),
    "deepseek-coder-v2-lite": (15.7, 2.4),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_presets_have_their_published_size(name):
    c = counts(ModelShape.from_config(catalog.model(name).config), 4096)
    total, active = PUBLISHED[name]
    assert c.total / 1e9 == pytest.approx(total, rel=0.02)
    assert c.active / 1e9 == pytest.approx(active, rel=0.1)


def test_design_facts_for_v2_lite_and_v3():
    lite, v3 = catalog.model("deepseek-v2-lite").config, catalog.model("deepseek-v3").config
    assert (
        lite["hidden_size"],
        lite["num_hidden_layers"],
        lite["n_routed_experts"],
        lite["num_experts_per_tok"],
    ) == (2048, 27, 64, 6)
    assert lite["rope_scaling"]["factor"] == 40 and lite["q_lora_rank"] is None
    assert (
        v3["hidden_size"],
        v3["num_hidden_layers"],
        v3["n_routed_experts"],
        v3["num_experts_per_tok"],
    ) == (7168, 61, 256, 8)
    assert (v3["n_group"], v3["topk_group"], v3["routed_scaling_factor"]) == (8, 4, 2.5)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(SpecError) as e:
        catalog.gpu("h100")
    assert e.value.field == "hardware.gpu" and "h100-80gb" in e.value.message


@pytest.mark.parametrize("name", ["tiny-v2", "tiny-v3"])
def test_tiny_presets_build_in_transformers(name):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from dskit.train.model import hf_config

    preset = catalog.model(name)
    model = AutoModelForCausalLM.from_config(hf_config(preset.config, "sdpa"))
    n = sum(p.numel() for p in model.parameters())
    assert n == counts(ModelShape.from_config(preset.config), 128).total
    assert model(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.shape == (
        1,
        8,
        preset.config["vocab_size"],
    )
