"""AdamW over one ZeRO partition in one pass: 16-bit gradient in, fp32 master and moments updated, 16-bit
weights out.

DeepSpeed's ZeRO-1/2 step spends three passes over every parameter where this spends one: it casts the
flat 16-bit gradient partition to a new fp32 tensor, steps torch's fused AdamW on it, then copies the fp32
master back into the 16-bit weights. At 2 bytes of gradient, 24 of master and moments and 2 of weights
read or written per parameter, this is 28 bytes where those passes are 40, and the fp32 gradient copy
(4 bytes a parameter) is never allocated. At micro-batch 1 on one H200 the three passes were a third of
the step's GPU time (bench/results/peer/h200-vs-torchtitan-profile-s2048-mb1-2026-12-04.json).

The arithmetic is torch's fused AdamW's (aten/src/ATen/native/cuda/fused_adam_utils.cuh, ADAMW mode),
including its `grad_scale` (the clip coefficient divides inside) and `found_inf` (a non-finite step leaves
master, moments, weights and the step count as they were). Its state is torch's AdamW's own (`step` an
fp32 scalar on the device, `exp_avg`, `exp_avg_sq`), so a checkpoint reads the same either way. On a GPU
the pass is one kernel that torch.compile generates; elsewhere (the CPU tests) the same function runs
eagerly.
"""

from __future__ import annotations

import torch

from dskit.train.gpu_compiled import on_gpu


def _adamw_pass(
    g16, p, m, v, w16, step, lr, scale, found_inf, beta1: float, beta2: float, eps: float, wd: float
):
    g = g16.float() / scale
    decayed = p - lr * wd * p  # torch's order: p * (1 - lr * wd) would round the factor in fp32
    m_new = beta1 * m + (1 - beta1) * g
    v_new = beta2 * v + (1 - beta2) * g * g
    bias1 = 1 - torch.pow(beta1, step)
    bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, step))
    p_new = decayed - (lr / bias1) * m_new / (torch.sqrt(v_new) / bias2_sqrt + eps)
    skip = found_inf != 0
    p_new = torch.where(skip, p, p_new)
    p.copy_(p_new)
    m.copy_(torch.where(skip, m, m_new))
    v.copy_(torch.where(skip, v, v_new))
    w16.copy_(p_new)


#: dynamic: one kernel for every partition size (the dense and the expert groups differ)
COMPILE_OPTIONS = {"fullgraph": True, "dynamic": True}
_pass_for = on_gpu(_adamw_pass, **COMPILE_OPTIONS)


def state_of(optimizer: torch.optim.AdamW, master: torch.Tensor) -> dict:
    """torch's AdamW state for `master`, created as its fused step creates it on a first step."""
    state = optimizer.state[master]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    step = state["step"]
    if not torch.is_tensor(step) or step.device != master.device or step.dtype != torch.float32:
        # a state loaded from elsewhere (a universal checkpoint puts ZeRO-1/2's count on the CPU)
        state["step"] = torch.as_tensor(step, dtype=torch.float32).to(master.device)
    return state


@torch.no_grad()
def step(
    optimizer: torch.optim.AdamW,
    group: dict,
    grad: torch.Tensor,
    master: torch.Tensor,
    weights: torch.Tensor,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """One AdamW step of `group` (whose only parameter is the flat fp32 `master`) from the flat 16-bit
    `grad`, divided by `grad_scale`; writes `master`, its moments and the flat 16-bit `weights`. Skipped
    where `found_inf` is non-zero. Nothing here reads a value back to the host."""
    if grad.numel() != master.numel() or weights.numel() != master.numel():
        raise ValueError(
            f"partition sizes differ: grad {grad.numel()}, master {master.numel()}, weights {weights.numel()}"
        )
    if group.get("amsgrad") or group.get("maximize"):
        raise ValueError("the one-pass AdamW step has neither amsgrad nor maximize")
    state = state_of(optimizer, master)
    dev = master.device
    found = found_inf if found_inf is not None else torch.zeros((), device=dev)
    scale = grad_scale if grad_scale is not None else torch.ones((), device=dev)
    state["step"].add_(1 - found)  # as torch's fused step: counted, and taken back on a skip
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    lr = lr.to(dev, torch.float32) if torch.is_tensor(lr) else torch.full((), float(lr), device=dev)
    _pass_for(dev)(
        grad.detach().view(-1),
        master.detach().view(-1),
        state["exp_avg"].view(-1),
        state["exp_avg_sq"].view(-1),
        weights.detach().view(-1),
        state["step"],
        lr,
        scale.float(),
        found.float(),
        float(beta1),
        float(beta2),
        float(group["eps"]),
        float(group["weight_decay"]),
    )
