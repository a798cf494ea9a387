"""The one-pass AdamW of ZeRO-1/2's fused step (dskit/train/adamw_cast.py) against torch's fused AdamW
on an fp32 copy of the gradient, the three passes it replaces: same master, moments, 16-bit weights and
state, including the clip coefficient divided inside and a skipped non-finite step."""

import copy
import math

import pytest
import torch

from dskit.train import adamw_cast

pytestmark = pytest.mark.train

N = 4099  # not a multiple of any vector width


def _reference_and_one_pass(dtype: torch.dtype, weight_decay: float):
    torch.manual_seed(0)
    master = torch.randn(N) * 0.1
    ref_master = master.clone().requires_grad_()
    one_master = master.clone().requires_grad_()
    hyper = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": weight_decay}
    ref = torch.optim.AdamW([ref_master], fused=True, **hyper)
    one = torch.optim.AdamW([one_master], fused=True, **hyper)
    weights = one_master.detach().to(dtype)
    return ref, ref_master, one, one_master, weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_pass_matches_torch_fused_adamw_over_steps_with_clip_and_a_skip(dtype):
    ref, ref_master, one, one_master, weights = _reference_and_one_pass(dtype, weight_decay=0.1)
    # step 3's gradient is not finite: both skip it (torch's found_inf), the count included
    plan = [(1.0, 0.0), (4.0, 0.0), (1.0, 1.0), (2.5, 0.0), (1.0, 0.0)]
    for k, (clip, inf) in enumerate(plan):
        grad16 = (torch.randn(N) * (k + 1)).to(dtype)
        if inf:
            grad16[7] = math.inf
        scale, found = torch.tensor(clip), torch.tensor(inf)
        ref_master.grad = grad16.float()
        ref.grad_scale, ref.found_inf = scale, found
        ref.step()
        adamw_cast.step(one, one.param_groups[0], grad16, one_master, weights, scale, found)

        r, o = ref.state[ref_master], one.state[one_master]
        assert float(o["step"]) == float(r["step"]) == sum(1 for _, f in plan[: k + 1] if not f)
        torch.testing.assert_close(one_master.detach(), ref_master.detach(), rtol=2e-6, atol=1e-8)
        # fp32 rounding apart (the order of a multiply and an add), where a moment nearly cancels
        torch.testing.assert_close(o["exp_avg"], r["exp_avg"], rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(o["exp_avg_sq"], r["exp_avg_sq"], rtol=2e-6, atol=1e-9)
        # the 16-bit weights are the master rounded, as DeepSpeed's copy-back makes them
        assert torch.equal(weights, one_master.detach().to(dtype))


def test_the_state_is_torch_adamws_own_so_checkpoints_read_either_way():
    ref, ref_master, one, one_master, weights = _reference_and_one_pass(torch.bfloat16, weight_decay=0.0)
    grad16 = torch.randn(N).to(torch.bfloat16)
    ref_master.grad = grad16.float()
    ref.step()
    adamw_cast.step(one, one.param_groups[0], grad16, one_master, weights, None, None)
    r, o = ref.state_dict()["state"][0], one.state_dict()["state"][0]
    assert {k: (v.dtype, v.shape, v.device) for k, v in o.items()} == {
        k: (v.dtype, v.shape, v.device) for k, v in r.items()
    }
    # and a state torch's step made continues under the one pass (a resume across the change)
    one.load_state_dict(copy.deepcopy(ref.state_dict()))  # a copy: torch's load shares same-device tensors
    with torch.no_grad():
        one_master.copy_(ref_master)
    for _ in range(2):
        grad16 = torch.randn(N).to(torch.bfloat16)
        ref_master.grad = grad16.float()
        ref.step()
        adamw_cast.step(one, one.param_groups[0], grad16, one_master, weights, None, None)
    torch.testing.assert_close(one_master.detach(), ref_master.detach(), rtol=2e-6, atol=1e-8)
    assert float(one.state[one_master]["step"]) == 3.0
    # a count loaded as a number or in another dtype (not torch's fused form) is taken as it is
    one.state[one_master]["step"] = 3
    adamw_cast.step(one, one.param_groups[0], grad16, one_master, weights, None, None)
    assert (
        one.state[one_master]["step"].dtype == torch.float32 and float(one.state[one_master]["step"]) == 4.0
    )


def test_mismatched_partitions_are_refused():
    _, _, one, one_master, weights = _reference_and_one_pass(torch.bfloat16, weight_decay=0.0)
    with pytest.raises(ValueError, match="partition sizes differ"):
        adamw_cast.step(
            one,
            one.param_groups[0],
            torch.zeros(N - 1, dtype=torch.bfloat16),
            one_master,
            weights,
            None,
            None,
        )


def test_the_compiled_pass_is_the_eager_one():
    """What the GPU runs is this function through torch.compile (Inductor writes the master, moments and
    weights in place): compiled here for the CPU with the same options, it must leave the same tensors,
    at two partition sizes (one kernel for both) and on a skipped step."""
    compiled = torch.compile(adamw_cast._adamw_pass, **adamw_cast.COMPILE_OPTIONS)
    torch.manual_seed(1)
    for n, inf in ((N, 0.0), (2 * N + 5, 0.0), (N, 1.0)):
        p, m, v = torch.randn(n) * 0.1, torch.randn(n) * 0.01, torch.rand(n) * 1e-4
        g16 = torch.randn(n).to(torch.bfloat16)
        if inf:
            g16[3], g16[4] = math.nan, math.inf  # what a skipped step carries
        args = (
            torch.tensor(3.0),
            torch.tensor(1e-3),
            torch.tensor(2.0),
            torch.tensor(inf),
            0.9,
            0.95,
            1e-8,
            0.1,
        )
        eager = [t.clone() for t in (p, m, v)] + [torch.zeros(n, dtype=torch.bfloat16)]
        ours = [t.clone() for t in (p, m, v)] + [torch.zeros(n, dtype=torch.bfloat16)]
        adamw_cast._adamw_pass(g16, *eager, *args)
        compiled(g16, *ours, *args)
        for a, b in zip(ours, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-9)
        if inf:
            assert torch.equal(ours[0], p)  # skipped: the master as it was
