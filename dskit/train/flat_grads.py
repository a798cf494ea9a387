"""On one rank, ZeRO-1/2's gradients accumulate straight into one flat buffer per parameter group.

DeepSpeed 0.19.8 runs a Python hook per parameter as autograd makes its gradient: it copies the gradient
into a reduce bucket, reduces the bucket over its group, copies each gradient again into the partition's
buffer (backward order, not the weights' order), and the step flattens the partition a third time, a
transient of 2 bytes per parameter. On one H200 at seq 2048, micro-batch 1 the step is host-bound (the
GPU busy 37% of it) and those hooks took 17 ms of it (bench/results/peer/
h200-vs-torchtitan-profile-s2048-mb1-2026-12-04b.json).

On one rank there is nothing to reduce. Each parameter's gradient lands in a view of a flat 16-bit buffer
laid out as the group's flat weights (`bit16_groups_flat`), and the fused step (dskit/train/fused_step.py)
reads the buffer as the partition's gradient. No buckets, no flatten; the norm is one reduction per group.
How a gradient lands (plan: `parallel.grad_first_write`):
- `add`: each `.grad` is set once to its view, so autograd's AccumulateGrad adds each new gradient into it
  in place (what DDP's gradient_as_bucket_view relies on); the buffer is zeroed after every step. Per
  parameter and step: a fill, then an add that reads the zeros back (8 bytes a bf16 element).
- `copy`: `.grad` stays None, AccumulateGrad hands each new gradient over without a copy, and a
  post-accumulate hook copies it into the view (4 bytes an element) and drops it; a later micro-step of
  the same step adds. Nothing is zeroed: a parameter that got no gradient in a step has its view zeroed
  at the step. On one H100 at V2-Lite's 3-layer seq-4096 step the fill and the add were 5.0 of 49.5 ms of
  kernels (bench/results/peer/h100-host-bound-profile-l3s4096-2026-12-06.json), but the hooks cost host
  time in the backward, which is what sets a host-bound step's pace. A/B on one H100, one call a shape:
  +21% at 4 layers seq 1024 micro-batch 1 (its `add` row 19% below the same shape's run that morning),
  +3.5% at 4 layers seq 2048 micro-batch 2, -11% at 6 layers seq 1024 micro-batch 2: no win beyond the
  machine's spread (bench/JOURNAL.md, "Host syncs by line"). The plan keeps `add`.

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


def attach(z, *, first_write: str = "add") -> list[torch.Tensor]:
    """Land every parameter's gradient in its group's flat buffer (`first_write`: "add" or "copy", above),
    and take DeepSpeed's per-gradient hooks and its end-of-backward reduction off this optimizer. Returns
    the buffers, one per group."""
    if first_write not in ("add", "copy"):
        raise ValueError(f"first_write is add or copy, got {first_write!r}")
    flats, views = [], {}
    for i, params in enumerate(z.bit16_groups):
        weights = z.bit16_groups_flat[i]
        if z.parallel_partitioned_bit16_groups[i][0].data_ptr() != weights.data_ptr():
            raise RuntimeError(f"parameter group {i}: the rank's partition is not its flat weights")
        grads = torch.zeros_like(weights)  # the groups' padding stays zero: nothing writes it
        for p in params:
            offset, rest = divmod(p.data_ptr() - weights.data_ptr(), p.element_size())
            if rest or not p.is_contiguous() or not 0 <= offset <= weights.numel() - p.numel():
                raise RuntimeError(f"parameter group {i}: a parameter is not a view of the flat weights")
            views[p] = grads.narrow(0, offset, p.numel()).view_as(p)
        flats.append(grads)
    for handle in z._grad_acc_hooks:
        handle.remove()
    z._grad_acc_hooks.clear()
    # the engine calls these after every backward: on one rank there is nothing to reduce or gather
    z.overlapping_partition_gradients_reduce_epilogue = lambda: None
    z.reduce_gradients = lambda pipeline_parallel=False: None
    if first_write == "add":
        for p, view in views.items():
            p.grad = view
        z.zero_grad = lambda set_to_none=True: [g.zero_() for g in flats] and None
    else:
        landing = _Landing(views)
        z.zero_grad = lambda set_to_none=True: landing.written.clear()
        z.dskit_landing = landing
    z.scaled_global_norm = lambda norm_type=2: _norm(z, flats, norm_type)
    z.dskit_flat_grads = flats
    return flats


class _Landing:
    """`copy`: the post-accumulate hooks, and which views hold this step's gradient."""

    def __init__(self, views: dict[torch.nn.Parameter, torch.Tensor]):
        # a frozen parameter never gets a gradient: its view stays zero
        self.views = {p: v for p, v in views.items() if p.requires_grad}
        self.written: set[torch.nn.Parameter] = set()
        for p in self.views:
            p.register_post_accumulate_grad_hook(self._land)

    def _land(self, p: torch.nn.Parameter) -> None:
        grad, p.grad = p.grad, None
        if p in self.written:  # a later micro-step of the step, or a second backward within one
            self.views[p].add_(grad)
        else:
            self.views[p].copy_(grad)
            self.written.add(p)

    def settle(self) -> None:
        """Before the step reads the buffers: a view no gradient reached this step holds zeros."""
        if len(self.written) == len(self.views):
            return
        for p, view in self.views.items():
            if p not in self.written:
                view.zero_()
                self.written.add(p)


def check_attached(z) -> None:
    """Raise if a parameter's `.grad` was replaced since attach(): autograd would then have put that
    gradient beside the buffer, and the step would silently miss it. (`copy`: a `.grad` that is not None
    at the step was set behind the hooks.) Then settle the views no gradient reached."""
    landing = getattr(z, "dskit_landing", None)
    for i, params in enumerate(z.bit16_groups):
        lo = z.dskit_flat_grads[i].data_ptr()
        hi = lo + z.dskit_flat_grads[i].numel() * z.dskit_flat_grads[i].element_size()
        for p in params:
            if landing is None and (p.grad is None or not lo <= p.grad.data_ptr() < hi):
                how = "set to None or reassigned"
            elif landing is not None and p.grad is not None:
                how = "assigned after its gradient was copied in"
            else:
                continue
            raise RuntimeError(
                f"a parameter's .grad was replaced outside the optimizer ({how}): "
                "the flat gradient buffers of one rank (dskit/train/flat_grads.py) no longer hold it"
            )
    if landing is not None:
        landing.settle()


def _norm(z, flats: list[torch.Tensor], norm_type) -> torch.Tensor:
    """The global L2 norm of the gradients in place of DeepSpeed's scaled_global_norm, -1 when not finite
    (as its per-group helpers mark it; scaled_global_norm itself returns +inf there, and the fused step
    skips on either); the groups' padding is zeros. One rank, no model parallelism: no all-reduce."""
    if float(norm_type) != 2.0:
        raise ValueError(f"the flat gradient norm is L2, got norm_type={norm_type}")
    sq = torch.stack([torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in flats]).double().pow(2)
    total = sq.sum().sqrt().float()
    return non_finite_as_minus_one(total)


def non_finite_as_minus_one(norm: torch.Tensor) -> torch.Tensor:
    """A norm as DeepSpeed's per-group helpers report it, -1 where not finite (`mask_nan_or_inf_with_val_inplace`),
    without that helper's two host syncs a step (a tensor made on the device from a Python float, and
    masked_fill_ reading it back; bench/results/training/h100-sync-sites-2026-12-06.json)."""
    return torch.where(norm.isfinite(), norm, torch.full_like(norm, -1.0))
