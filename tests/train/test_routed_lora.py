"""Routed-expert LoRA's parts on real modules, without a trainer (dskit/train/lora/routed.py): the delta
composes after an earlier parametrization of the same weight (the FP8 base's dequantisation), and the
exported layout is peft's exactly (dskit/train/lora/export_adapter.py). The trainer's side (AutoEP, ZeRO,
checkpoints, peft loading the export) is tests/train/test_lora.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from dskit.train.lora.routed import PROJECTIONS, ExpertDelta

E, H, INTER, R = 4, 24, 16, 3


class _Dequant(nn.Module):
    """What an FP8 base registers first: the stored weight times a per-expert scale."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.scale


def _experts():
    from deepspeed.moe.ep_experts import GroupedExperts

    g = GroupedExperts(dim=H, hidden_dim=INTER, num_experts=E, use_grouped_mm=False)
    torch.manual_seed(0)
    for p in g.parameters():
        nn.init.normal_(p, std=0.1)
        p.requires_grad_(False)
    return g


def _random_delta(w: torch.Tensor, scale: float) -> ExpertDelta:
    e, out_f, in_f = w.shape
    d = ExpertDelta(e, out_f, in_f, R, scale, torch.float32)
    with torch.no_grad():
        d.lora_A.normal_()
        d.lora_B.normal_()
    return d


def test_the_delta_composes_after_a_dequantising_parametrization():
    g = _experts()
    stored = {n: getattr(g, n).detach().clone() for n, _ in PROJECTIONS}
    scales = {n: torch.rand(E, 1, 1) + 0.5 for n, _ in PROJECTIONS}
    deltas = {}
    for n, _ in PROJECTIONS:
        parametrize.register_parametrization(g, n, _Dequant(scales[n]), unsafe=True)
        deltas[n] = _random_delta(stored[n], 0.5)
        parametrize.register_parametrization(g, n, deltas[n], unsafe=True)
    for n, _ in PROJECTIONS:
        d = deltas[n]
        want = stored[n] * scales[n] + 0.5 * torch.bmm(d.lora_B, d.lora_A)
        torch.testing.assert_close(getattr(g, n), want)
    # AutoEP's forward reads the effective weights; gradients reach A and B only
    x, counts = torch.randn(10, H), torch.tensor([3, 2, 4, 1])
    g(x, counts).square().sum().backward()
    assert all(d.lora_A.grad is not None and d.lora_B.grad.abs().sum() > 0 for d in deltas.values())
    assert all(p.grad is None for n, p in g.named_parameters() if n.endswith(".original"))


@pytest.mark.parametrize("model", ["tiny-v2", "tiny-v3"])
def test_the_exported_layout_is_peft_s_per_expert_delta(model):
    """Per-expert gate, up and down adapters as dskit's checkpoint holds them -> peft's keys and layout
    (gate and up as one block-diagonal rank-2r adapter): peft's ParamWrapper computes, for every expert,
    the delta the merged export adds, which is dskit's own W + alpha/r B A per projection."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from dskit import catalog
    from dskit.train.lora.export_adapter import ROUTED_TARGETS, _routed, _routed_delta, peft_routed
    from dskit.train.lora.inject import _no_v4_rename
    from dskit.train.model import hf_config

    cfg = catalog.model(model).config
    m = AutoModelForCausalLM.from_config(hf_config(cfg, "sdpa"))
    n_exp, h, inter, r, alpha = (
        cfg["n_routed_experts"],
        cfg["hidden_size"],
        cfg["moe_intermediate_size"],
        4,
        12.0,
    )
    layer = f"model.layers.{cfg.get('first_k_dense_replace') or 0}.mlp"
    g = torch.Generator().manual_seed(1)
    ours = {}
    for proj, (out_f, in_f) in {"w1": (inter, h), "w3": (inter, h), "w2": (h, inter)}.items():
        ours[f"{layer}.experts.{proj}.lora_A"] = torch.randn(n_exp, r, in_f, generator=g)
        ours[f"{layer}.experts.{proj}.lora_B"] = torch.randn(n_exp, out_f, r, generator=g)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_parameters=list(ROUTED_TARGETS),
        rank_pattern={ROUTED_TARGETS[0]: 2 * r},
        alpha_pattern={ROUTED_TARGETS[0]: 2 * alpha},
    )
    with _no_v4_rename():
        inject_adapter_in_model(config, m)
    result = set_peft_model_state_dict(m, peft_routed(ours))
    assert not [k for k in result.unexpected_keys if layer in k]
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = {
        w.parameter_name: w for n, w in m.named_modules() if isinstance(w, ParamWrapper) and layer in n
    }
    assert sorted(wrappers) == ["down_proj", "gate_up_proj"]
    mine = _routed(ours)[layer]
    for proj in ("gate_up_proj", "down_proj"):
        got = wrappers[proj].get_delta_weight("default")
        want = _routed_delta(mine, proj, alpha / r)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # gate rows are gate's own adapter, per expert: W + alpha/r B_gate A_gate
    gate = alpha / r * torch.bmm(ours[f"{layer}.experts.w1.lora_B"], ours[f"{layer}.experts.w1.lora_A"])
    torch.testing.assert_close(wrappers["gate_up_proj"].get_delta_weight("default")[:, :inter], gate)
