"""DeepSpeed ZeRO-1/2's optimizer step without two of its passes over every gradient.

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
  (`skipped_counter`), read with the rest of a metrics record;
- the cast of the gradient partition to fp32, AdamW and the copy of the master back into the 16-bit
  weights are one pass (dskit/train/adamw_cast.py), where DeepSpeed's step makes three.
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


class Refused(TypeError):
    """The engine cannot take what the plan's `field` asks of it (a run.yaml edited past what it admits)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def install(zero_optimizer, *, flat: bool = False, first_write: str = "add") -> None:
    """Replace the passes on this DeepSpeedZeroOptimizer instance (stage 1 or 2 on the device, torch fused
    AdamW). `flat`: the plan's gradients go flat on the one rank (dskit/plan/memory.py `flat_gradients`,
    dskit/train/flat_grads.py), landing there by `first_write` ("add" or "copy"); an engine that cannot
    take them is an error, not a fallback."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from dskit.train import flat_grads

    z = zero_optimizer
    inner = z.optimizer
    if not isinstance(inner, torch.optim.AdamW) or not inner.defaults.get("fused"):
        raise Refused(
            "parallel.optimizer_step",
            f"the fused step needs torch's fused AdamW inside ZeRO, got {type(inner).__name__}",
        )
    # the plan asks for the fused step only where none of these is on (dskit/plan/schema.py)
    unsupported = {
        "optimizer offload": z.cpu_offload,
        "ZenFlow": z.zenflow,
        "torch autocast's GradScaler": z.torch_autocast_gradscaler is not None,
    }
    if any(unsupported.values()):
        raise Refused(
            "parallel.optimizer_step",
            f"the fused step does not run with {[k for k, on in unsupported.items() if on]}",
        )

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
        return flat_grads.non_finite_as_minus_one(total.sqrt().float())

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        inner.found_inf = None  # no norm (clip 0): nothing to skip by, whatever the last step was
        if total_norm is not None:
            norm = (
                total_norm
                if torch.is_tensor(total_norm)
                else torch.tensor(float(total_norm), device=z.device)
            ).float()
            # DeepSpeed's norm helpers report a non-finite norm as -1 (flat_grads.non_finite_as_minus_one)
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
    inner.found_inf = None
    inner.grad_scale = None
    z.get_grad_norm_direct = get_grad_norm_direct
    z.unscale_and_clip_grads = unscale_and_clip_grads
    z.step = lambda closure=None: _step(z)
    if flat:
        why = flat_grads.refused(z)
        if why:
            raise Refused("parallel.gradients", f"the plan's flat gradients do not run here: {why}")
        flat_grads.attach(z, first_write=first_write)


def _step(z) -> None:
    """DeepSpeed 0.19.8's DeepSpeedZeroOptimizer.step (stage_1_and_2.py) on the path install() admits (no
    offload, ZenFlow or GradScaler; AdamW, so no Muon; its timers and memory reports left out), with the gradient's
    cast, AdamW and the weights' copy-back as one pass per parameter group."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import all_gather_dp_groups, is_invalid_grad_norm
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    from dskit.train import adamw_cast, flat_grads

    flats = getattr(z, "dskit_flat_grads", None)
    if flats is not None:
        flat_grads.check_attached(z)
    z.micro_step_id = INITIAL_MICRO_STEP_ID
    if not z.compute_grad_norm:
        z._global_grad_norm = None
    z.overflow = False
    if z.check_grad_overflow:
        z.check_overflow(partition_gradients=z.partition_gradients)
    norm = None
    if z.compute_grad_norm and not z.overflow:
        norm = z.scaled_global_norm()
        if (z.dtype != torch.bfloat16 or z.check_grad_overflow) and is_invalid_grad_norm(norm):
            z.overflow = True
    prev_scale = z.loss_scale
    z._update_scale(z.overflow)
    inner = z.optimizer
    if z.overflow:  # DeepSpeed's own check found it (fp16, or bf16 with the check on): no step
        inner.found_inf = None  # not the last step's: step_taken() reads DeepSpeed's overflow flag instead
        if z.compute_grad_norm:
            z._global_grad_norm = float("inf")
        z.zero_grad(set_to_none=True)
        z._release_preflattened_grad_buffers()
        for k in z.averaged_gradients.keys():
            z.averaged_gradients[k] = None
            z.all_grad_tensors[k] = None
        return
    if norm is not None:
        z._global_grad_norm = norm / prev_scale
    # once per step, not per parameter group: it counts a skipped step and sets found_inf and grad_scale
    # (the gradients are not touched)
    z.unscale_and_clip_grads([], norm)
    for i in range(len(z.bit16_groups)):
        group_rank = dist.get_rank(group=z.real_dp_process_group[i])
        if flats is not None:  # the buffer is the partition's gradient; zero_grad() clears it after the step
            adamw_cast.step(
                inner,
                inner.param_groups[i],
                flats[i],
                master=z.single_partition_of_fp32_groups[i],
                weights=z.parallel_partitioned_bit16_groups[i][0],
                grad_scale=inner.grad_scale,
                found_inf=inner.found_inf,
            )
            continue
        z.free_grad_in_param_list(z.params_not_in_partition[i])
        grad = z._get_preflattened_grad_partition(i)
        if grad is None:
            if group_rank == dist.get_world_size(group=z.real_dp_process_group[i]) - 1:
                grad = z.flatten_dense_tensors_aligned(z.averaged_gradients[i], int(z.partition_size[i]))
            else:
                grad = z.flatten(z.averaged_gradients[i])
        z.free_grad_in_param_list(z.params_in_partition[i])
        z._release_preflattened_grad_buffers(i)
        z.averaged_gradients[i] = None
        z.all_grad_tensors[i] = None
        adamw_cast.step(
            inner,
            inner.param_groups[i],
            grad,
            master=z.single_partition_of_fp32_groups[i],
            weights=z.parallel_partitioned_bit16_groups[i][group_rank],
            grad_scale=inner.grad_scale,
            found_inf=inner.found_inf,
        )
        del grad
    z._lazy_init_hp_params_optimizer_state()
    if flats is not None:  # one rank: the weights written are the parameters' own storage, nothing to gather
        return
    all_gather_dp_groups(
        groups_flat=z.bit16_groups_flat,
        partitioned_param_groups=z.parallel_partitioned_bit16_groups,
        dp_process_group=z.real_dp_process_group,
        start_alignment_factor=z.nccl_start_alignment_factor,
        allgather_bucket_size=z.allgather_bucket_size,
    )
    for i in range(len(z.bit16_groups)):
        z._update_model_bit16_weights(i)


def _inner(engine):
    """The torch optimizer inside the engine's ZeRO optimizer (None: another engine)."""
    return getattr(getattr(engine, "optimizer", None), "optimizer", None)


def gradients(engine) -> str:
    """Where this engine's ZeRO-1/2 gradients went: "flat" (dskit/train/flat_grads.py) or DeepSpeed's
    "buckets"."""
    return "flat" if hasattr(getattr(engine, "optimizer", None), "dskit_flat_grads") else "buckets"


def grad_first_write(engine) -> str | None:
    """How flat gradients landed in their buffers ("add" or "copy", dskit/train/flat_grads.py); None where
    they did not go flat."""
    z = getattr(engine, "optimizer", None)
    if not hasattr(z, "dskit_flat_grads"):
        return None
    return "copy" if hasattr(z, "dskit_landing") else "add"


def installed(engine) -> bool:
    """Whether this engine steps through the fused step (install() leaves its counter on it)."""
    return hasattr(_inner(engine), "dskit_skipped")


def skipped_counter(engine) -> torch.Tensor | None:
    """Steps the fused step skipped for a non-finite gradient norm so far, as the counter on the device
    (the log window reads it with the rest of a record); None where the engine does not run the fused step."""
    return _inner(engine).dskit_skipped if installed(engine) else None


def step_taken(engine) -> torch.Tensor | float:
    """1 where the last optimizer step was applied, 0 where it was skipped for a non-finite gradient
    norm: for the fused step a tensor on the device (no host sync), else DeepSpeed's own flag."""
    found = getattr(_inner(engine), "found_inf", None)
    if found is not None:
        return 1.0 - found
    return 0.0 if getattr(getattr(engine, "optimizer", None), "overflow", False) else 1.0
