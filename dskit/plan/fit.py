"""What "fits" means, and the one-line error when nothing does.

A plan fits when every estimate stays under its limit:
- on each GPU, the steady-state training estimate and the construction peak (`dskit/plan/memory.py`)
  under (1 - GPU_MEMORY_MARGIN, or overrides.gpu_memory_margin; both in dskit/spec/plan_overrides.py) x the usable memory (the catalog's usable_memory_gib: what torch
  reports, not the datasheet);
- on each host, the RAM of its ranks while building and while training (`dskit/plan/host_memory.py`) under
  (1 - HOST_MEMORY_MARGIN) x hardware.host_memory_gib.
A capacity that is unknown (the cpu profile) is not checked. When no candidate fits, `choose` raises
SpecError (exit 2) naming what does not fit, the numbers and what to change, before anything is
rendered or queued (`explain_no_fit`). Which fitting candidate wins is `dskit/plan/search.py`'s call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dskit.catalog import GPU
from dskit.plan import host_memory, memory
from dskit.plan.adapters import Tuning
from dskit.plan.candidate import Candidate, Cluster, Workload
from dskit.spec.plan_overrides import GPU_MEMORY_MARGIN  # where overrides.gpu_memory_margin is validated

# What the node needs besides the ranks: the OS, the filesystem client's cache, the container runtime,
# slurmd or the kubelet (Kubernetes reserves system memory the same way).
HOST_MEMORY_MARGIN = 0.10
# "Use at least N nodes" searches up to this many nodes; beyond, no node count is suggested.
MAX_NODES = 4096


@dataclass(frozen=True)
class Setting:
    """Everything the fit depends on besides the candidate: what trains, on what, with how much host RAM."""

    model: str  # the model's name, for messages
    work: Workload
    cluster: Cluster
    host_memory_gib: float | None  # per node; None: unknown, not checked
    host_memory_from: str  # where host_memory_gib came from, for messages
    loads_weights: bool
    gpu_margin: float = GPU_MEMORY_MARGIN  # overrides.gpu_memory_margin

    @property
    def gpu(self) -> GPU:
        return self.cluster.gpu

    @property
    def world(self) -> int:
        return self.cluster.world

    @property
    def nodes(self) -> int:
        return self.cluster.nodes

    @property
    def per_node(self) -> int:
        return self.cluster.per_node

    @property
    def tuning(self) -> Tuning | None:
        return self.work.tuning

    def grad_accum(self, c: Candidate) -> int:
        return self.work.grad_accum(c)

    def with_nodes(self, nodes: int) -> Setting:
        """The same global batch over `nodes` nodes: fewer sequences per rank, at least one."""
        world = nodes * self.per_node
        per_rank = max(1, self.work.per_rank * self.world // world)
        return dataclasses.replace(
            self,
            work=dataclasses.replace(self.work, per_rank=per_rank),
            cluster=dataclasses.replace(self.cluster, world=world),
        )

    @property
    def where(self) -> str:
        return f"{self.model} on {self.nodes}x{self.per_node} {self.gpu.name}"

    @property
    def gpu_limit(self) -> float | None:
        u = self.gpu.usable_memory_gib
        return None if u is None else u * (1 - self.gpu_margin)

    @property
    def host_limit(self) -> float | None:
        h = self.host_memory_gib
        return None if h is None else h * (1 - HOST_MEMORY_MARGIN)


@dataclass(frozen=True)
class Fit:
    candidate: Candidate
    steady: memory.MemoryEstimate
    construction: memory.ConstructionEstimate
    host: host_memory.HostEstimate
    setting: Setting

    @property
    def peak_gib(self) -> float:
        """The larger of the steady-state and construction estimates per GPU."""
        return max(self.steady.total_gib, self.construction.total_gib)

    @property
    def gpu_ok(self) -> bool:
        limit = self.setting.gpu_limit
        return limit is None or self.peak_gib <= limit

    @property
    def host_ok(self) -> bool:
        limit = self.setting.host_limit
        return limit is None or self.host.total_gib <= limit

    def as_dict(self) -> dict[str, Any]:
        """The plan's `memory` section: per GPU, then per node (GiB)."""
        s = self.setting

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 2)

        return {
            **self.steady.as_dict(),
            "construction_gib": r(self.construction.total_gib),
            "construction": {k: r(v) for k, v in dataclasses.asdict(self.construction).items()},
            "capacity_gib": s.gpu.usable_memory_gib,
            "limit_gib": r(s.gpu_limit),
            "host_gib": r(self.host.total_gib),
            "host_construction_gib": r(self.host.construction_gib),
            "host_training_gib": r(self.host.training_gib),
            "host_capacity_gib": s.host_memory_gib,
            "host_limit_gib": r(s.host_limit),
        }


def evaluate(s: Setting, c: Candidate) -> Fit:
    on_gpu = s.cluster.on_gpu
    steady = memory.estimate(s.work, c, s.cluster)
    build = memory.construction(
        s.work.counts,
        world=s.world,
        ep_size=c.ep_size,
        on_gpu=on_gpu,
        zero_stage=c.zero_stage,
        tuning=s.tuning,
    )
    h = host_memory.estimate(
        s.work.counts,
        world=s.world,
        ranks_per_node=s.per_node,
        offload_optimizer=c.offload,
        loads_weights=s.loads_weights,
        device_gib_per_rank=0.0 if on_gpu else steady.total_gib,
        device_construction_gib_per_rank=0.0 if on_gpu else build.total_gib,
        trainable=None if s.tuning is None else s.tuning.trainable,
    )
    return Fit(c, steady, build, h, s)


def explain_no_fit(
    s: Setting, fits: list[Fit], own: Candidate | None, forced: list[str], ep_for: Callable[[int], list[int]]
) -> tuple[str, str]:
    """(field, message) when no candidate fits. `own`: the planner's pick without the user's overrides
    (`forced`: their spec keys), or None; it tells "your override does not fit" from "this cluster is
    too small". `ep_for(world)`: the EP sizes the search takes at another world size, for the "use N nodes" hint."""
    if forced and own is not None:  # the override, not the cluster, is what does not fit
        best = min(fits, key=lambda f: f.peak_gib)
        return forced[0], (
            f"{s.where} does not fit with {', '.join(forced)} as set: {_numbers(best)}; the planner's own "
            f"choice fits ({own.describe()}): remove {' and '.join(forced)}"
        )
    least = min(fits, key=lambda f: f.construction.total_gib)  # the best EP's (and stage's)
    b = least.construction
    if s.gpu_limit is not None and b.total_gib > s.gpu_limit and s.tuning is not None and s.tuning.fp8:
        # ZeRO-1/2 only (an fp8 base): a GPU holds the non-expert base whole, so only EP shrinks it
        return "finetune.base_precision", (
            f"{s.where} cannot hold an fp8 base: each GPU holds the non-expert base whole and 1/ep of the "
            f"experts, in FP8 ({b.shard_gib:.1f} GiB at EP {least.candidate.ep_size}), over {gpu_limit_text(s)}; "
            + _or(
                _more_nodes(s, fits, ep_for),
                "finetune.base_precision=bf16 (ZeRO-3 shards a bf16 base, dequantised while loading; "
                "`dskit plan` says whether it fits here)",
            )
        )
    sharded = [f for f in fits if f.candidate.zero_stage == 3]
    if s.gpu_limit is not None and b.total_gib > s.gpu_limit and not sharded:
        # only ZeRO-1/2 were searched (overrides.zero_stage, or cuda_graphs=on's narrowing): more nodes never
        # shrink the whole model
        graphs = "overrides.zero_stage" not in forced and "overrides.cuda_graphs" in forced
        return ("overrides.cuda_graphs" if graphs else "overrides.zero_stage"), (
            f"{s.where} cannot be built under ZeRO-{least.candidate.zero_stage}: it builds the whole 16-bit model "
            f"({b.shard_gib:.1f} GiB) on each GPU, over {gpu_limit_text(s)}; "
            + ("on needs ZeRO-1/2: use overrides.cuda_graphs=off" if graphs else "use overrides.zero_stage=3")
        )
    if sharded:  # what more nodes shrink: ZeRO-3's shard (ZeRO-1/2 build the whole model on every GPU)
        least = min(sharded, key=lambda f: f.construction.total_gib)
        b = least.construction
    if s.gpu_limit is not None and b.total_gib > s.gpu_limit:
        return "hardware.nodes", (
            f"{s.where} cannot be built: construction peaks at {b.total_gib:.1f} GiB/GPU ({b.shard_gib:.1f} weight "
            f"shard + {b.gathered_gib:.1f} largest module gathered whole + {b.autoep_copy_gib:.1f} AutoEP copy of "
            f"one layer's local experts + {b.overhead_gib:.1f} overhead), over {gpu_limit_text(s)}; "
            + _or(
                _more_nodes(s, fits, ep_for),
                f"a GPU with more memory (hardware.gpu): one module alone is {b.gathered_gib:.1f} GiB",
            )
        )
    on_gpu = [f for f in fits if f.gpu_ok]
    if on_gpu:
        f = min(on_gpu, key=lambda f: f.host.total_gib)
        h = f.host
        need = h.total_gib / (1 - HOST_MEMORY_MARGIN)
        what = (
            f"{h.offload_gib:.1f} for optimizer offload: {host_memory.OFFLOAD_STATE_BYTES} B fp32 states + "
            f"{host_memory.OFFLOAD_PINNED_BYTES} B pinned gradient buffers per parameter of each rank's shard, and the "
            "optimizer's init buffer; "
            if h.offload_gib
            else ""
        )
        return "hardware.host_memory_gib", (
            f"{s.where} needs {h.total_gib:.1f} GiB of host RAM per node ({what}{h.baseline_gib:.1f} for "
            f"{h.ranks} rank(s) at {host_memory.HOST_BASELINE_GIB} GiB each; {h.construction_gib:.1f} while building) but the "
            f"limit is {s.host_limit:.1f} GiB ({1 - HOST_MEMORY_MARGIN:.0%} of {s.host_memory_gib} GiB, "
            f"{s.host_memory_from}); "
            + _or(
                _more_nodes(s, fits, ep_for), f"hosts with at least {need:.0f} GiB (hardware.host_memory_gib)"
            )
        )
    best = min(fits, key=lambda f: f.steady.total_gib)
    return "hardware.nodes", (
        f"{s.where} does not fit: {_numbers(best)}; "
        + _or(
            _more_nodes(s, fits, ep_for),
            "a shorter training.seq_len",
            "a GPU with more memory (hardware.gpu)",
        )
    )


def gpu_limit_text(s: Setting) -> str:
    """'the 71.2 GiB limit (90% of 79.11 GiB usable)', naming overrides.gpu_memory_margin where it was set."""
    pinned = "" if s.gpu_margin == GPU_MEMORY_MARGIN else f", overrides.gpu_memory_margin {s.gpu_margin:g}"
    return f"the {s.gpu_limit:.1f} GiB limit ({1 - s.gpu_margin:.0%} of {s.gpu.usable_memory_gib} GiB usable{pinned})"


def _numbers(f: Fit) -> str:
    e, s, b = f.steady, f.setting, f.construction
    if s.gpu_limit is not None and b.total_gib > s.gpu_limit and b.total_gib >= e.total_gib:
        if f.candidate.zero_stage != 3:
            return (
                f"building it peaks at {b.total_gib:.1f} GiB/GPU at {f.candidate.describe()} (the whole 16-bit "
                f"model, {b.shard_gib:.1f} GiB, on each GPU), over {gpu_limit_text(s)}"
            )
        return (
            f"building it peaks at {b.total_gib:.1f} GiB/GPU at {f.candidate.describe()} ({b.shard_gib:.1f} weight "
            f"shard, {b.gathered_gib:.1f} largest module, {b.autoep_copy_gib:.1f} AutoEP copy), over {gpu_limit_text(s)}"
        )
    if s.gpu_limit is not None and e.total_gib > s.gpu_limit:
        return (
            f"training needs {e.total_gib:.1f} GiB/GPU at {f.candidate.describe()} (states {e.states_gib:.1f}, "
            f"working set {e.working_set_gib:.1f}, activations {e.activations_gib:.1f}, logits {e.logits_gib:.1f}, "
            f"overhead {e.overhead_gib:.1f}), over {gpu_limit_text(s)}"
        )
    return (
        f"host RAM per node needs {f.host.total_gib:.1f} GiB at {f.candidate.describe()}, over the "
        f"{s.host_limit:.1f} GiB limit ({s.host_memory_from})"
    )


def _or(*options: str | None) -> str:
    """'use A, or B, or C' over the options that apply."""
    return "use " + ", or ".join(o for o in options if o)


def _more_nodes(s: Setting, fits: list[Fit], ep_for: Callable[[int], list[int]]) -> str | None:
    """'at least N nodes of G (hardware.nodes)', or None when no node count up to MAX_NODES fits: the
    fewest nodes at which one of the candidates fits at an EP size the search takes there."""
    cands = {dataclasses.replace(f.candidate, ep_size=0) for f in fits}

    def ok(nodes: int) -> bool:
        t = s.with_nodes(nodes)
        return any(
            (f := evaluate(t, dataclasses.replace(c, ep_size=ep))).gpu_ok and f.host_ok
            for ep in ep_for(nodes * s.per_node)
            for c in cands
        )

    lo, hi = s.nodes, s.nodes * 2
    while hi <= MAX_NODES and not ok(hi):
        lo, hi = hi, hi * 2
    if hi > MAX_NODES:
        return None
    while hi - lo > 1:  # every estimate shrinks as nodes grow: bisect between a miss and a fit
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return f"at least {hi} nodes of {s.per_node} (hardware.nodes)"
