"""A candidate the search weighs, and what every candidate of one plan shares.

`Candidate` is one point of the search (`search.py`): the ZeRO stage, the EP size, the micro-batch,
activation checkpointing and optimizer offload. The memory model (`memory.estimate`) and the step-time
model (`speed.predict`) take a candidate with the two things it is weighed in: the `Workload` (the
model's shape and counts at the plan's sequence length, the batch per rank, and the plan-wide choices
the search does not vary: precision, compile, the optimizer step, the loss, LoRA) and the `Cluster`
(the GPU profile and where the ranks are).
"""

from __future__ import annotations

from dataclasses import dataclass

from dskit.catalog import GPU
from dskit.plan.adapters import Tuning
from dskit.plan.model_math import ModelCounts
from dskit.plan.shape import ModelShape


@dataclass(frozen=True)
class Candidate:
    ep_size: int
    micro_batch: int
    ckpt_every: int
    offload: bool
    zero_stage: int = 3

    @property
    def recompute_share(self) -> float:
        """About the share of decoder layers whose forward runs twice (1/N; exactly ceil(L/N)/L, which
        orders candidates the same way): the tie order's key."""
        return 1 / self.ckpt_every if self.ckpt_every else 0.0

    def describe(self) -> str:
        ckpt = (
            f"activation checkpointing every {self.ckpt_every}"
            if self.ckpt_every
            else "no activation checkpointing"
        )
        return (
            f"ZeRO-{self.zero_stage}, EP {self.ep_size}, micro-batch {self.micro_batch}, {ckpt}, "
            f"{'optimizer offload' if self.offload else 'no offload'}"
        )


@dataclass(frozen=True)
class Fp8Compute:
    """The products a run computes in FP8 (dskit/plan/fp8_training.py): their training FLOPs per token and
    the speed-up measured for them over bf16 (below 1: slower)."""

    linear_flops_per_token: float
    linear_speedup: float
    expert_flops_per_token: float = 0.0
    expert_speedup: float = 1.0

    @property
    def flops_saved_per_token(self) -> float:
        """bf16-equivalent FLOPs per token the FP8 products take off the step (negative: they add)."""
        return self.linear_flops_per_token * (1 - 1 / self.linear_speedup) + self.expert_flops_per_token * (
            1 - 1 / self.expert_speedup
        )


@dataclass(frozen=True)
class Workload:
    """What every candidate of one plan trains, and the plan-wide choices it trains with."""

    shape: ModelShape
    counts: ModelCounts  # at seq_len
    #: training FLOPs per token (`model_math.flops_per_token`, or a LoRA run's `Tuning.flops_per_token`)
    flops_per_token: float
    seq_len: int
    per_rank: int  # sequences per rank and optimizer step: micro-batch x accumulation
    tuning: Tuning | None = None  # a LoRA run's trainable and frozen parts (dskit/plan/adapters.py)
    precision: str = "bf16"
    compiled: bool = False  # regional torch.compile (parallel.compile_regions)
    compiled_attention: bool = False  # whole attention blocks compiled where the stage allows it
    fused_step: bool = False  # overrides.optimizer_step is not deepspeed (where ZeRO-1/2 admit it)
    loss: str = "auto"  # overrides.loss: auto | chunked | full (memory.loss_chunk_for)
    fp8: Fp8Compute | None = None  # training.fp8: the products in FP8 (None: all bf16)

    def grad_accum(self, c: Candidate) -> int:
        return self.per_rank // c.micro_batch

    def tokens(self, c: Candidate) -> int:
        """Tokens per micro-step and rank."""
        return c.micro_batch * self.seq_len


@dataclass(frozen=True)
class Layout:
    """Where the ranks are: what the bandwidths depend on."""

    world: int
    per_node: int
    ep_size: int

    @property
    def expert_dp(self) -> int:
        return self.world // self.ep_size


@dataclass(frozen=True)
class Cluster:
    """The GPUs a plan runs on: their profile and where the ranks are."""

    gpu: GPU
    world: int  # ranks, one per GPU
    per_node: int  # ranks per node
    peak_tflops: float | None = None  # at the plan's precision (HardwarePlan.peak_tflops)
    host_threads: int = 8  # CPU cores per rank: an offloaded optimizer steps on them

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    @property
    def on_gpu(self) -> bool:
        return not self.gpu.is_cpu

    def layout(self, c: Candidate) -> Layout:
        return Layout(world=self.world, per_node=self.per_node, ep_size=c.ep_size)
