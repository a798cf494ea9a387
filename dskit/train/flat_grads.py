"""On one rank, ZeRO-1/2's gradients accumulate straight into one flat buffer per parameter group.

DeepSpeed 0.19.8 runs a Python hook per parameter as autograd makes its gradient: it copies the gradient
into a reduce bucket, reduces the bucket over its group, copies each gradient again into the partition's
buffer (backward order, not the weights' order), and the step flattens the partition a third time, a
transient of 2 bytes per parameter. On one H200 at seq 2048, micro-batch 1 the step is host-bound (the
GPU busy 37% of it) and those hooks took 17 ms of it (bench/results/peer/
h200-vs-torchtitan-profile-s2048-mb1-2026-12-04b.json).

On one rank there is nothing to reduce. Each parameter's `.grad` is set once to a view of a flat 16-bit
buffer laid out as the group's flat weights (`bit16_groups_flat`), so autograd's AccumulateGrad adds each
new gradient into it in place (what DDP's gradient_as_bucket_view relies on), accumulation over micro-steps
is that same add, and the fused step (dskit/train/fused_step.py) reads the buffer as the partition's
gradient. No hooks, no buckets, no copies, no flatten; the norm is one reduction per group.

Admitted only where nothing else reads DeepSpeed's gradient structures: every group's data-parallel world
is the one rank, no overflow check (bf16 with the fused step; fp16 keeps DeepSpeed's path), no grad_accum attribute.
"""

from __future__ import annotations

import torch


def refused(z) -> str | None:
    """Why this ZeRO-1/2 optimizer (its fused step installed) cannot take its gradients flat; None: it can."""
    from deepspeed import comm as dist

    why = {
        f"{dist.get_world_size()} ranks": dist.get_world_size() != 1,
        "DeepSpeed's overflow check (fp16, or bf16 with check_grad_overflow)": z.check_grad_overflow,
        "the grad_accum attribute": z.use_grad_accum_attribute,
        "a separate gradient accumulation dtype (data_types.grad_accum_dtype)": z.use_separate_grad_accum,
        "optimizer offload": z.cpu_offload,
        "ZenFlow": z.zenflow,
    }
    on = [k for k, v in why.items() if v]
    return ", ".join(on) or None


def attach(z) -> list[torch.Tensor]:
    """Point every parameter's `.grad` into its group's flat buffer, and take DeepSpeed's per-gradient
    hooks and its end-of-backward reduction off this optimizer. Returns the buffers, one per group."""
    flats = []
    for i, params in enumerate(z.bit16_groups):
        weights = z.bit16_groups_flat[i]
        if z.parallel_partitioned_bit16_groups[i][0].data_ptr() != weights.data_ptr():
            raise RuntimeError(f"parameter group {i}: the rank's partition is not its flat weights")
        grads = torch.zeros_like(weights)
        for p in params:
            offset, rest = divmod(p.data_ptr() - weights.data_ptr(), p.element_size())
            if rest or not p.is_contiguous() or not 0 <= offset <= weights.numel() - p.numel():
                raise RuntimeError(f"parameter group {i}: a parameter is not a view of the flat weights")
            p.grad = grads.narrow(0, offset, p.numel()).view_as(p)
        flats.append(grads)
    for handle in z._grad_acc_hooks:
        handle.remove()
    z._grad_acc_hooks.clear()
    # the engine calls these after every backward: on one rank there is nothing to reduce or gather
    z.overlapping_partition_gradients_reduce_epilogue = lambda: None
    z.reduce_gradients = lambda pipeline_parallel=False: None
    z.zero_grad = lambda set_to_none=True: [g.zero_() for g in flats] and None
    z.scaled_global_norm = lambda norm_type=2: _norm(z, flats, norm_type)
    z.dskit_flat_grads = flats
    return flats


def check_attached(z) -> None:
    """Raise if a parameter's `.grad` was replaced since attach(): autograd would then have put that
    gradient beside the buffer, and the step would silently miss it."""
    for i, params in enumerate(z.bit16_groups):
        lo = z.dskit_flat_grads[i].data_ptr()
        hi = lo + z.dskit_flat_grads[i].numel() * z.dskit_flat_grads[i].element_size()
        for p in params:
            if p.grad is None or not lo <= p.grad.data_ptr() < hi:
                raise RuntimeError(
                    "a parameter's .grad was replaced outside the optimizer (set to None or reassigned): "
                    "the flat gradient buffers of one rank (dskit/train/flat_grads.py) no longer hold it"
                )


def _norm(z, flats: list[torch.Tensor], norm_type) -> torch.Tensor:
    """The global L2 norm of the gradients, as DeepSpeed's scaled_global_norm reports it (-1 when not
    finite); the groups' padding is zeros. One rank, no model parallelism: no all-reduce."""
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

    if float(norm_type) != 2.0:
        raise ValueError(f"the flat gradient norm is L2, got norm_type={norm_type}")
    sq = torch.stack([torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in flats]).double().pow(2)
    total = sq.sum().sqrt().float()
    mask_nan_or_inf_with_val_inplace(total, device=z.device)
    return total
