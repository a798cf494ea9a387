"""DeepSpeed ZeRO-1/2's optimizer step without two of its passes over every gradient (issue 25).

DeepSpeed 0.19.8 takes the gradient norm by copying each bf16 gradient to fp64 (`get_norm_dtype`),
and divides every fp32 gradient by the clip coefficient in a separate pass, even when that coefficient
is 1. At micro-batch 2 on one H200 those passes are work proportional to the parameters, not the tokens
(bench/README.md). Here:
- each gradient's norm is accumulated in fp32 straight from its bf16 values (`vector_norm(dtype=float32)`:
  no copy), as torch's own clip_grad_norm_ does for fp32 gradients, and the per-tensor norms are summed
  in fp64;
- the clip coefficient is handed to torch's fused AdamW as its `grad_scale`, which divides inside the
  Adam kernel, so no pass is spent on it;
- a step whose gradient norm is not finite is skipped inside the same kernel (its `found_inf`, as
  torch's GradScaler uses it: parameters, moments and step count left as they were), so DeepSpeed's
  bf16 overflow check, a max and a min over every gradient and a host synchronisation each step, is
  switched off for this step (dskit/plan/deepspeed.py). The skipped steps are counted on the GPU
  (`skipped_steps`), read only when metrics are logged.
Only ZeRO-1/2 without offload: ZeRO-3's and the CPU optimizer's steps are left as DeepSpeed has them.
"""

from __future__ import annotations

import math

import torch


def adamw(params, opt: dict) -> torch.optim.AdamW:
    """torch's fused AdamW from the DeepSpeed config's `optimizer.params` (betas, eps, weight decay), over
    the parameter groups DeepSpeed makes of `params`: the experts apart, for their own data-parallel group."""
    from deepspeed.moe.utils import configure_moe_param_groups

    p = opt["params"]
    return torch.optim.AdamW(
        configure_moe_param_groups(list(params)),
        lr=p["lr"],
        betas=tuple(p["betas"]),
        eps=p["eps"],
        weight_decay=p["weight_decay"],
        fused=True,
    )


def install(zero_optimizer) -> None:
    """Replace the two passes on this DeepSpeedZeroOptimizer instance (stage 1 or 2, torch fused AdamW)."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace

    z = zero_optimizer
    inner = z.optimizer
    if not isinstance(inner, torch.optim.AdamW) or not inner.defaults.get("fused"):
        raise TypeError(f"the fused step needs torch's fused AdamW inside ZeRO, got {type(inner).__name__}")

    def get_grad_norm_direct(gradients, params, norm_type=2):
        # DeepSpeed's L2 branch (stage_1_and_2.py), the fp64 copy of every gradient left out
        if float(norm_type) != 2.0:
            return type(z).get_grad_norm_direct(z, gradients, params, norm_type)
        norms = [
            torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32)
            for g, p in zip(
                (g for g in gradients if not getattr(g, "_zero_padding", False)), params, strict=False
            )
            if not getattr(p, "ds_pipe_replicated", False)
            and (is_model_parallel_parameter(p) or z.model_parallel_rank == 0)
        ]
        # the squares of a few hundred per-tensor norms in fp64: in fp32 a finite norm past ~1.8e19 would
        # square to inf and skip a step that DeepSpeed's fp64 norm clips
        total = (
            torch.stack(norms).double().pow(2).sum() if norms else torch.zeros((), device=z.device).double()
        )
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=z.dp_process_group)
        z._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        total = total.sqrt().float()
        mask_nan_or_inf_with_val_inplace(total, device=z.device)
        return total

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        if total_norm is not None:
            norm = (
                total_norm
                if torch.is_tensor(total_norm)
                else torch.tensor(float(total_norm), device=z.device)
            ).float()
            # DeepSpeed's norm helpers report a non-finite norm as -1 (mask_nan_or_inf_with_val_inplace)
            bad = (norm < 0) | ~torch.isfinite(norm)
            inner.found_inf = bad.float().reshape(())
            inner.dskit_skipped = inner.dskit_skipped + inner.found_inf
        if z.clip_grad == 0.0 and z.loss_scale == 1.0:
            inner.grad_scale = None
            return
        scale = torch.full((), float(z.loss_scale), device=z.device)
        if z.clip_grad > 0.0:
            norm = torch.where(bad, torch.full_like(norm, math.inf), norm)
            clip = torch.clamp((norm / z.loss_scale + 1e-6) / z.clip_grad, min=1.0)
            scale = clip * z.loss_scale
        inner.grad_scale = scale.float()  # fused AdamW divides each gradient by it in its kernel

    inner.dskit_skipped = torch.zeros((), device=z.device)
    z.get_grad_norm_direct = get_grad_norm_direct
    z.unscale_and_clip_grads = unscale_and_clip_grads


def _inner(engine):
    """The torch optimizer inside the engine's ZeRO optimizer (None: another engine)."""
    return getattr(getattr(engine, "optimizer", None), "optimizer", None)


def installed(engine) -> bool:
    """Whether this engine steps through the fused step (install() leaves its counter on it)."""
    return hasattr(_inner(engine), "dskit_skipped")


def skipped_steps(engine) -> int | None:
    """Steps the fused step skipped for a non-finite gradient norm so far (a host sync: call it when
    logging); None where the engine does not run the fused step."""
    return int(_inner(engine).dskit_skipped.item()) if installed(engine) else None


def step_taken(engine) -> torch.Tensor | float:
    """1 where the last optimizer step was applied, 0 where it was skipped for a non-finite gradient
    norm: for the fused step a tensor on the device (no host sync), else DeepSpeed's own flag."""
    found = getattr(_inner(engine), "found_inf", None)
    if found is not None:
        return 1.0 - found
    return 0.0 if getattr(getattr(engine, "optimizer", None), "overflow", False) else 1.0
