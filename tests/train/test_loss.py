"""The chunked linear + cross-entropy computes the same loss and gradients as the plain path, and
returns it where ZeRO-3's hooks see it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dskit.train.loss import IGNORE_INDEX, LMOutput, linear_cross_entropy


def plain(hidden, weight, labels):
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.mark.parametrize(
    "dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)]
)
@pytest.mark.parametrize("chunk", [7, 64, 10_000])
def test_same_loss_and_gradients_as_plain_cross_entropy(dtype, rtol, chunk):
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(3, 50, 32, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(301, 32, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    labels = torch.randint(0, 301, (3, 50), generator=g)
    labels[0, :5] = IGNORE_INDEX
    results = []
    chunked = lambda h, w, y: linear_cross_entropy(h, w, y, chunk)  # noqa: E731
    for fn in (plain, chunked):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss = fn(h, w, labels) * 3.0  # a non-unit upstream gradient
        loss.backward()
        results.append((loss.detach().double(), h.grad.double(), w.grad.double()))
    (l0, h0, w0), (l1, h1, w1) = results
    assert torch.isfinite(l1)
    for want, got in ((l0, l1), (h0, h1), (w0, w1)):
        assert ((got - want).norm() / want.norm()).item() < rtol


def test_all_ignored_rows_give_zero_loss_and_gradients():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((4,), IGNORE_INDEX), 2)
    loss.backward()
    assert loss.item() == 0 and hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


@pytest.mark.parametrize("field", ["loss", "logits"])
def test_zero3_hooks_find_the_tensor_in_the_model_output(field):
    """ZeRO-3 runs a module's pre-backward hook (gather its parameters for backward) from an autograd
    function it wraps around each tensor of the module's output; `apply_to_tensors_only` finds them in
    tuples, lists and dicts only. The output was once a plain dataclass: the hook never saw the loss and
    DeepSpeed warned at every start."""
    from deepspeed.runtime.zero.utils import apply_to_tensors_only

    t = torch.ones(3, requires_grad=True)
    seen: list[torch.Tensor] = []

    def wrap(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return x * 2

    out = apply_to_tensors_only(wrap, LMOutput(**{"loss": None, "logits": None, field: t}))
    assert len(seen) == 1 and seen[0] is t
    assert isinstance(out, LMOutput) and torch.equal(getattr(out, field), t * 2)
