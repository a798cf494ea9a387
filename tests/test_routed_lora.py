"""Routed-expert LoRA's parts on real modules, without a trainer (dskit/train/routed_lora.py): the delta
composes after an earlier parametrization of the same weight (the FP8 base's dequantisation). The
trainer's side (AutoEP, ZeRO, checkpoints) is tests/test_lora.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from dskit.train.routed_lora import PROJECTIONS, ExpertDelta

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
