"""Predicted step time of one candidate configuration: the planner picks the fastest that fits.

A model, not a simulator: a few terms, each with a physical reason, and the constants that cannot be
derived measured on H200 (`bench/results/h200-planner-*.json`, pinned by tests/test_speed.py). Per GPU,
per optimizer step of `grad_accum` micro-steps of T = micro_batch x seq_len tokens:

    step = grad_accum x (compute + module_overhead + fixed + exposed_zero3 + all_to_all) + optimizer

- compute: T x FLOPs/token (6 x active parameters + causal attention; `model_math.py`), plus the forward
  pass again for every checkpointed layer (a third of a layer's training FLOPs), at GEMM_EFFICIENCY of
  the GPU's peak. The efficiency absorbs the token-proportional non-GEMM kernels (norms, RoPE, SwiGLU,
  casts, MoE permutes), which were as long as the GEMMs in the H200 profile (bench/README.md).
- module_overhead: ZeRO-3 runs hooks around every module (gather, release, reduce) and launches
  hundreds of small kernels per layer; the GPU waited a third of the H200 step for the host. Paid per
  layer pass (forward, backward, and the recompute of checkpointed layers), independent of T.
- fixed: per micro-step costs independent of layers and tokens (the loss, the balance statistics, the
  engine's bookkeeping).
- exposed_zero3: all-gathers of the 16-bit weights (forward, backward, recompute) and the gradient
  reduce-scatter, over the group's bandwidth (NVLink inside a node, the fabric across nodes); ZeRO-3
  prefetches on a side stream, so ZERO3_OVERLAP of it hides behind compute.
- all_to_all: AutoEP's dispatch and combine of every routed token copy (k per token), forward and
  backward (and recompute), to the (ep-1)/ep of experts held elsewhere.
- optimizer: Adam over this rank's shard of ALL parameters (not just the active ones), bound by memory
  bandwidth on the GPU; with offload, DeepSpeed's CPU Adam on the host plus the PCIe round trip of
  gradients and weights.

Small micro-steps lose to the fixed and per-layer costs; long accumulation multiplies them; activation
checkpointing buys memory with recompute. That trade is what the planner weighs (`search.py`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dskit.catalog import GPU
from dskit.plan.model_math import ModelCounts

# ---- measured (bench/results/h200-planner-2026-11-30.json; fitted by bench/plan_bench.py --fit) ----
#: achieved fraction of the GPU's peak on the model's training FLOPs at large micro-steps
GEMM_EFFICIENCY = 0.43
#: host-side cost of one layer pass (forward, backward or recompute) under ZeRO-3 hooks, seconds
LAYER_PASS_S = 0.0099
#: per micro-step cost independent of depth and tokens, seconds
MICRO_STEP_FIXED_S = 0.0
#: bytes FusedAdam reads and writes per parameter (bf16 weight and grad, fp32 master, m, v, and the
#: ZeRO-3 flat-buffer copies): 18.5 ms for 2.26 B parameters at 4.8 TB/s in the H200 profile
ADAM_BYTES_PER_PARAM = 39.0

# ---- first principles, cited ----
#: fraction of ZeRO-3's collectives hidden behind compute by its prefetch on a side stream (DeepSpeed
#: overlap_comm); not measured here beyond 2 GPUs: half is the conservative middle
ZERO3_OVERLAP = 0.5
#: DeepSpeed CPU-Adam: 0.22 s per billion parameters on a two-socket Xeon node (ZeRO-Offload, Ren et
#: al. 2021, Table 3: 1 B parameters); ranks of a node share it
CPU_ADAM_S_PER_BPARAM_NODE = 0.22
#: offload traffic per parameter and step: fp32 gradient to the host, bf16 weight back
OFFLOAD_BYTES_PER_PARAM = 6
#: 16-bit weights and gradients
WIRE_BYTES = 2
GB = 1e9


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
class StepTime:
    """Predicted seconds per optimizer step, by term (all per GPU)."""

    compute_s: float
    module_overhead_s: float
    fixed_s: float
    zero3_s: float
    all_to_all_s: float
    optimizer_s: float
    tokens_per_step: int  # per GPU
    flops_per_token: float
    peak_tflops: float
    unknown: tuple[str, ...]  # terms left out for want of a bandwidth (named in --explain)

    @property
    def step_s(self) -> float:
        return (
            self.compute_s
            + self.module_overhead_s
            + self.fixed_s
            + self.zero3_s
            + self.all_to_all_s
            + self.optimizer_s
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.tokens_per_s * self.flops_per_token / (self.peak_tflops * 1e12)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            k: round(v, 4) for k, v in asdict(self).items() if k.endswith("_s") and isinstance(v, float)
        }
        d["step_s"] = round(self.step_s, 4)
        d["tokens_per_s_per_gpu"] = round(self.tokens_per_s)
        d["mfu"] = round(self.mfu, 4)
        if self.unknown:
            d["not_counted"] = list(self.unknown)
        return d


def checkpointed_fraction(layers: int, ckpt_every: int) -> float:
    """Share of layers recomputed in backward (dskit/train/model.py checkpoints layer i when i % N == 0)."""
    return 0.0 if not ckpt_every else math.ceil(layers / ckpt_every) / layers


def _bandwidth(group: int, layout: Layout, gpu: GPU, fabric_gbs: float | None) -> float | None:
    """GB/s per GPU for a collective over `group` consecutive ranks: NVLink/PCIe inside a node, else the
    fabric (a ring or all-to-all spanning nodes runs at its slowest link)."""
    if group <= layout.per_node:
        return gpu.interconnect_gbs
    return fabric_gbs


def predict(
    cfg: dict[str, Any],
    c: ModelCounts,
    flops_per_token: float,
    *,
    gpu: GPU,
    peak_tflops: float | None,
    fabric_gbs: float | None,
    layout: Layout,
    micro_batch: int,
    grad_accum: int,
    seq_len: int,
    ckpt_every: int,
    offload: bool,
) -> StepTime | None:
    """Predicted step time, or None where the GPU has no peak to scale from (the cpu profile).
    `peak_tflops`: at the plan's precision."""
    if peak_tflops is None or gpu.memory_bw_gbs is None:
        return None
    peak = peak_tflops * 1e12
    L = cfg["num_hidden_layers"]
    T = micro_batch * seq_len
    frac = checkpointed_fraction(L, ckpt_every)
    unknown: list[str] = []

    compute = T * flops_per_token * (1 + frac / 3) / (peak * GEMM_EFFICIENCY)
    passes = L * (2 + frac)
    module_overhead = LAYER_PASS_S * passes

    # ZeRO-3: weights gathered per pass, gradients reduce-scattered once per micro-step; a group of one
    # rank moves nothing. Experts are sharded over the expert-data-parallel group, the rest over all.
    dense_params = c.total - c.experts_per_layer * _moe_layers(cfg)
    expert_params = c.experts_per_layer * _moe_layers(cfg) / layout.ep_size
    zero3 = 0.0
    for params, group in ((dense_params, layout.world), (expert_params, layout.expert_dp)):
        if group == 1:
            continue
        bw = _bandwidth(group, layout, gpu, fabric_gbs)
        if bw is None:
            unknown.append("ZeRO-3 collectives across nodes (fabric bandwidth unknown)")
            continue
        volume = WIRE_BYTES * params * (group - 1) / group * ((2 + frac) + 1)
        zero3 += volume / (bw * GB) * (1 - ZERO3_OVERLAP)

    a2a = 0.0
    if layout.ep_size > 1:
        bw = _bandwidth(layout.ep_size, layout, gpu, fabric_gbs)
        if bw is None:
            unknown.append("all-to-all across nodes (fabric bandwidth unknown)")
        else:
            moe_passes = _moe_layers(cfg) * (2 * 2 + 2 * frac)  # dispatch + combine per pass
            copy_bytes = T * cfg["num_experts_per_tok"] * cfg["hidden_size"] * WIRE_BYTES
            a2a = moe_passes * copy_bytes * (layout.ep_size - 1) / layout.ep_size / (bw * GB)

    local_params = c.total / layout.world
    if offload:
        pcie = gpu.pcie_gbs or gpu.interconnect_gbs or 1.0
        optimizer = (
            local_params * layout.per_node / 1e9 * CPU_ADAM_S_PER_BPARAM_NODE
            + local_params * OFFLOAD_BYTES_PER_PARAM / (pcie * GB)
        )
    else:
        optimizer = local_params * ADAM_BYTES_PER_PARAM / (gpu.memory_bw_gbs * GB)

    return StepTime(
        compute_s=grad_accum * compute,
        module_overhead_s=grad_accum * module_overhead,
        fixed_s=grad_accum * MICRO_STEP_FIXED_S,
        zero3_s=grad_accum * zero3,
        all_to_all_s=grad_accum * a2a,
        optimizer_s=optimizer,
        tokens_per_step=grad_accum * T,
        flops_per_token=flops_per_token,
        peak_tflops=peak_tflops,
        unknown=tuple(dict.fromkeys(unknown)),
    )


def _moe_layers(cfg: dict[str, Any]) -> int:
    L = cfg["num_hidden_layers"]
    return L - min(cfg.get("first_k_dense_replace") or 0, L)
