"""The FP8 compute path's wiring on the CPU (dskit/train/fp8/compute.py): which modules convert, that a
converted model holds and saves exactly what a bf16 one does, and that a device without FP8 is refused.
FP8's numerics and speed are measured on the GPU (bench/fp8_gemm_bench.py, bench/train_bench.py --fp8);
here the casts are torchao's emulation, which checks the wiring and nothing about speed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dskit import catalog
from dskit.train.fp8 import compute

ROLES = ["self_attn.o_proj", "mlp.shared_experts.down_proj"]


@pytest.fixture
def tiny():
    from transformers import AutoModelForCausalLM

    from dskit.train.model import hf_config

    torch.manual_seed(0)
    cfg = dict(catalog.model("tiny-v2").config)
    return AutoModelForCausalLM.from_config(hf_config(cfg, "sdpa"), dtype=torch.bfloat16), cfg


def _convert(model, roles=ROLES):
    return compute.convert_linears(model, "tensorwise", roles, emulate=True, compiled=False)


def test_the_planned_roles_and_only_they_compute_in_fp8(tiny):
    model, cfg = tiny
    done = _convert(model)
    layers, dense = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    assert sorted({compute.role(n) for n in done.linears}) == sorted(ROLES)
    assert len(done.linears) == layers + (
        layers - dense
    )  # o_proj in each layer, shared experts in MoE layers
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            assert type(m) is nn.Linear  # still a plain linear: peft, ZeRO and checkpoints see no new type
            assert ("forward" in vars(m)) == (name in done.linears)
    assert done.as_record()["roles"] == sorted(ROLES)


def test_a_role_the_model_lacks_converts_nothing(tiny):
    model, _ = tiny
    # dynamo's own patch, not monkeypatch: undoing a module attribute deletes this config's entry (its
    # __delattr__ hides it), and a later compile in this process fails reading it. The limit before it is
    # whatever an earlier test of this process left (dskit/train/compile.py raises it for the run)
    before = torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(recompile_limit=8):
        compute.fp8_product.cache_clear()  # a product built earlier in this process would skip its body
        done = compute.convert_linears(model, "tensorwise", ["self_attn.q_b_proj"], emulate=True)
        assert done.linears == []  # tiny-v2 has no q LoRA
        # and builds no FP8 product: the compiled one would raise dynamo's recompile limit for the whole run
        assert torch._dynamo.config.recompile_limit == 8
        assert compute.convert_linears(model, "tensorwise", ROLES, emulate=True).linears
        assert torch._dynamo.config.recompile_limit == 256
    assert torch._dynamo.config.recompile_limit == before


def test_a_converted_linear_computes_through_fp8_and_trains(tiny):
    model, _ = tiny
    name = "model.layers.1.self_attn.o_proj"
    lin = model.get_submodule(name)
    x = torch.randn(32, lin.in_features, dtype=torch.bfloat16)
    plain = lin(x)
    _convert(model)
    y = lin(x)
    # FP8 (e4m3: 3 mantissa bits) rounds where bf16 does not, and stays close
    assert not torch.equal(y, plain)
    assert (y.float() - plain.float()).norm() / plain.float().norm() < 0.1
    y.sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.bfloat16


def test_a_checkpoint_round_trips_unchanged(tiny, tmp_path):
    model, cfg = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _convert(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    torch.save(after, tmp_path / "model.pt")
    from transformers import AutoModelForCausalLM

    from dskit.train.model import hf_config

    fresh = AutoModelForCausalLM.from_config(hf_config(cfg, "sdpa"), dtype=torch.bfloat16)
    _convert(fresh)
    fresh.load_state_dict(torch.load(tmp_path / "model.pt"), strict=True)
    ids = torch.randint(0, cfg["vocab_size"], (1, 16))
    assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)


def test_the_experts_get_the_fp8_forward_and_16_row_groups(monkeypatch):
    from deepspeed.moe import ep_kernels
    from deepspeed.moe.ep_experts import GroupedExperts

    monkeypatch.setattr(ep_kernels, "TOKEN_GROUP_ALIGN_SIZE_M", 8)  # AutoEP's own; restored after the test
    holder = nn.ModuleList([GroupedExperts(dim=32, hidden_dim=16, num_experts=4, use_grouped_mm=False)])
    assert compute.convert_experts(holder) == 1
    assert holder[0].forward.__func__ is compute._fp8_experts_forward
    assert ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M == compute.ALIGN


def test_a_device_without_fp8_is_refused_by_the_trainer():
    assert compute.device_unmet(torch.device("cpu")) == "has no FP8 tensor cores"


def test_a_micro_step_of_tokens_not_a_multiple_of_16_trains(tiny):
    """FP8 GEMMs want every side a multiple of 16, and the weight gradient's runs over the tokens (1000-token
    rows, 504-wide pad buckets): the product pads its inner dimension instead of failing in the kernel. The
    CPU's emulation does not enforce the kernel's alignment, so the setting itself is checked too."""
    fn = compute.fp8_product("tensorwise", emulate=True, compiled=False)
    config = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__), strict=True))[
        "config"
    ]
    assert config.pad_inner_dim
    model, _ = tiny
    _convert(model)
    lin = model.get_submodule("model.layers.1.self_attn.o_proj")
    x = torch.randn(1, 1000 + 3, lin.in_features, dtype=torch.bfloat16, requires_grad=True)
    lin(x).sum().backward()
    assert lin.weight.grad.shape == lin.weight.shape and x.grad.shape == x.shape


def test_doctor_reports_torchao_without_importing_it_on_a_host_without_a_gpu():
    from dskit.host.doctor import run_checks

    (line,) = [c for c in run_checks() if c.name == "torchao"]
    assert line.status == "PASS" and line.detail == "0.18.0 (FP8 GEMM not run: no GPU here)"
