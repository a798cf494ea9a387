"""Host RAM per node: what the ranks of one node hold in CPU memory, while building and while training.

Training with optimizer offload (ZeRO-Offload through DeepSpeed ZeRO-3, `offload_optimizer: cpu` with
`pin_memory: true`, as `dskit/plan/deepspeed.py` writes it) keeps, per rank, for its 1/world shard of
the parameters (ZeRO-3 shards non-expert states over all ranks and AutoEP's experts over the expert-data-
parallel group: both come to P / world per rank):

- OFFLOAD_STATE_BYTES: the fp32 master weights, Adam momentum and variance (ZeRO-Offload, Ren et al.
  2021), 12 bytes per parameter;
- OFFLOAD_PINNED_BYTES: the pinned buffers DeepSpeed 0.19.8 adds (runtime/zero/stage3.py): the fp32
  gradient of each optimizer sub-group (`initialize_optimizer_states`, 4 B) and the flat gradient
  partition in the gradient-accumulation dtype, bf16/fp16 under ZeRO (`grad_partitions_flat_buffer`,
  2 B). Pinned pages cannot be swapped or reclaimed;
- OFFLOAD_INIT_TRANSIENT_BYTES: while the optimizer initialises, an unpinned fp32 buffer the size of
  the largest sub-group (`gradient_buffer`, at most DS_SUB_GROUP_SIZE elements) exists on the host too.

Every process also carries HOST_BASELINE_GIB. Building the model from real weights adds one
safetensors shard per rank (HF_SHARD_GIB) being copied into the partitioned parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from dskit.catalog import GPU
from dskit.plan.model_math import ModelCounts

GIB = 2**30
OFFLOAD_STATE_BYTES = 12
OFFLOAD_PINNED_BYTES = 4 + 2
OFFLOAD_INIT_TRANSIENT_BYTES = 4
# DeepSpeed's zero_optimization.sub_group_size default (elements); dskit leaves it at the default.
DS_SUB_GROUP_SIZE = 10**9
# Resident memory of one rank before any model state: what importing torch, a cuBLAS matmul, cuDNN
# attention, an NCCL all-reduce and importing transformers leave resident, rounded well up for what such
# a reading does not load: DeepSpeed and its CPU-Adam extension, the model's Python module tree, the
# tokenised data and the checkpoint writer's buffers (the reading: docs/planner.md "The model's constants
# and their evidence").
HOST_BASELINE_GIB = 4.0
# transformers' save_pretrained default max_shard_size "5GB" (DeepSeek-V3's published shards are
# ~4.3 GB): each rank holds the shard it is copying from while weights load.
HF_SHARD_GIB = 5e9 / GIB


@dataclass(frozen=True)
class HostEstimate:
    """Host RAM per node (GiB), for the ranks of one node."""

    ranks: int
    baseline_gib: float  # ranks x HOST_BASELINE_GIB
    construction_gib: float  # peak while building: baseline + weight shards loading (+ cpu device part)
    offload_gib: float  # optimizer states + pinned buffers + init transient, 0 without offload
    device_gib: float  # cpu profile: the training "GPU" estimate lives in host RAM too

    @property
    def training_gib(self) -> float:
        return self.baseline_gib + self.offload_gib + self.device_gib

    @property
    def total_gib(self) -> float:
        return max(self.construction_gib, self.training_gib)


def estimate(
    c: ModelCounts,
    *,
    world: int,
    ranks_per_node: int,
    offload_optimizer: bool,
    loads_weights: bool,
    device_gib_per_rank: float = 0.0,
    device_construction_gib_per_rank: float = 0.0,
    trainable: int | None = None,
) -> HostEstimate:
    """The device_* arguments: on the cpu profile, the per-rank "GPU" estimates, which are host RAM.
    `trainable`: a LoRA run's trainable parameters, the only ones with (offloaded) optimizer states."""
    shard = (c.total if trainable is None else trainable) / world
    offload = 0.0
    if offload_optimizer:
        per_rank = (OFFLOAD_STATE_BYTES + OFFLOAD_PINNED_BYTES) * shard
        per_rank += OFFLOAD_INIT_TRANSIENT_BYTES * min(shard, DS_SUB_GROUP_SIZE)
        offload = ranks_per_node * per_rank / GIB
    baseline = ranks_per_node * HOST_BASELINE_GIB
    construction = baseline + ranks_per_node * (
        (HF_SHARD_GIB if loads_weights else 0.0) + device_construction_gib_per_rank
    )
    return HostEstimate(
        ranks=ranks_per_node,
        baseline_gib=baseline,
        construction_gib=construction,
        offload_gib=offload,
        device_gib=ranks_per_node * device_gib_per_rank,
    )


def threads_per_rank(cpus_per_node: int | None, ranks_per_node: int, is_cpu: bool) -> int:
    """OMP_NUM_THREADS of a rank (the launch contract), and so the cores its CPU Adam steps on:
    `hardware.cpus_per_node` split over the node's ranks, else 8 per GPU (1 per cpu-profile process)."""
    if cpus_per_node:
        return max(1, cpus_per_node // ranks_per_node)
    return 1 if is_cpu else 8


def node_memory(given_gib: float | None, gpu: GPU, gpus_per_node: int) -> tuple[float | None, str]:
    """Host RAM per node and where it came from: `hardware.host_memory_gib` (`given_gib`), else the GPU
    type's reference node; None where neither is known (not checked)."""
    if given_gib is not None:
        return given_gib, "hardware.host_memory_gib"
    per_gpu = gpu.host_memory_gib_per_gpu
    if per_gpu is None:
        return None, "unknown"
    n = gpus_per_node
    return float(per_gpu * n), f"default: {per_gpu:g} GiB per {gpu.name} of its reference node x {n}"
