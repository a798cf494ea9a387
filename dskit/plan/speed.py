"""Predicted step time of one candidate configuration: the planner picks the fastest that fits.

A model, not a simulator: a few terms, each with a physical reason, and the constants that cannot be
derived fitted to training steps measured on H200 (the runs and the fits: docs/planner.md; pinned by
tests/plan/test_plan_calibration.py). A user's `dskit calibrate` replaces the collective rates with
its measurements and scales the fitted terms by its probes (dskit/calibrate/scales.py). Per GPU,
per optimizer step of `grad_accum` micro-steps of T = micro_batch x seq_len tokens, two timelines run
side by side, because the host enqueues kernels ahead of the GPU:

    GPU  = grad_accum x (compute + layer_gpu + collectives + all_to_all + ZeRO-2's grad_copy)
    host = grad_accum x (HOST_LAYER_PASS_S x layer passes + HOST_MICRO_STEP_S)
    step = max(GPU, host) + optimizer + boundary
           (one rank's fused step, which nothing waits for: max(GPU + optimizer, host) + boundary)

- compute: T x FLOPs/token (6 x active parameters + causal attention; `model_math.py`), plus the forward
  pass again for every checkpointed layer (a third of a layer's training FLOPs), at GEMM_EFFICIENCY of
  the GPU's peak. The efficiency absorbs the token-proportional non-GEMM kernels (norms, RoPE, SwiGLU,
  casts, MoE permutes), which were as long as the GEMMs in the H200 profile (bench/README.md); regional
  torch.compile fuses some of them (COMPILED_COMPUTE_SAVING).
- layer passes: forward, backward, and the recompute of checkpointed layers. Each costs the GPU a little
  beyond its FLOPs, and the host much more: ZeRO-3 runs hooks around every module and launches hundreds
  of small kernels per layer. Small micro-steps are host-bound (measured: 4096-token micro-steps of a
  4-layer V2-Lite take as long as 8192-token ones), large ones GPU-bound.
- collectives: all-gathers of the 16-bit weights (forward, backward, recompute) and the gradient
  reduce-scatter, each over its process group's shape (dskit/plan/links.py: NCCL's ring over the node's
  link inside a node, over the NICs the group's local ranks own across nodes); each pass's
  transfers run behind that pass's compute (`compute_windows`), and only the share of the next layer the
  rendered live limit lets DeepSpeed gather ahead starts early (dskit/plan/prefetch.py);
  plus a measured synchronisation cost per layer pass.
- ZeRO-1 and 2 (`zero_stage`) keep the 16-bit weights on every rank: no per-layer gathers and no
  module hooks. Stage 2 reduce-scatters the gradients every micro-step, overlapped with the backward
  like ZeRO-3's; stage 1 once per step, at the accumulation boundary. Both all-gather the updated
  weights once per step after the optimizer, exposed. Their host and GPU cost per layer pass are
  HOST_LAYER_PASS_UNHOOKED_S and GPU_LAYER_PASS_UNHOOKED_S. grad_copy: they copy the gradients into
  reduce buckets and the rank's partition, stage 2 in every micro-step (on the GPU timeline), stage 1
  once per step, exposed with its boundary (on one GPU that is all that tells them apart).
- all_to_all: AutoEP's dispatch and combine of every routed token copy (k per token), forward and
  backward (and recompute), to the (ep-1)/ep of experts held elsewhere, over the EP group's shape.
- optimizer: Adam over this rank's shard of ALL parameters (not just the active ones), bound by memory
  bandwidth on the GPU, at each engine's own measured rate; with offload, DeepSpeed's CPU Adam on the
  rank's host cores, plus the PCIe round trip of gradients and weights.

Small micro-steps lose to the fixed and per-layer costs; long accumulation multiplies them; activation
checkpointing buys memory with recompute. That trade is what the planner weighs (`search.py`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dskit.calibrate.scales import FITTED, Scales
from dskit.catalog import GPU
from dskit.plan import links as links_
from dskit.plan import model_math
from dskit.plan.adapters import Tuning
from dskit.plan.candidate import Candidate, Cluster, Layout, Workload
from dskit.plan.links import Links
from dskit.plan.memory import flat_gradients, one_rank_fused
from dskit.plan.model_math import ModelCounts
from dskit.plan.prefetch import PERSISTENCE_THRESHOLD, gathered_layer_params, max_live, prefetched_share
from dskit.plan.shape import ModelShape

# ---- measured: the first four fitted together to the worst relative step-time error of one-GPU runs
# (bench/plan_bench.py --fit), kept when the optimizer terms were refitted (bench/optimizer_refit.py);
# the runs and the errors: docs/planner.md "Validation on H200" ----
#: achieved fraction of the GPU's peak on the model's training FLOPs
GEMM_EFFICIENCY = 0.45
#: GPU time per layer pass beyond its FLOPs (ZeRO-3's copies of gathered and released weights, the
#: MoE permutes' fixed part), seconds
GPU_LAYER_PASS_S = 0.0065
#: host time per layer pass (ZeRO-3's module hooks, hundreds of kernel launches), seconds; it runs
#: ahead of the GPU asynchronously, so a micro-step costs the larger of the two timelines
HOST_LAYER_PASS_S = 0.0115
#: host time per micro-step besides the layers (the engine's forward/backward entry, the loss, the
#: balance statistics), seconds
HOST_MICRO_STEP_S = 0.055
#: ZeRO-3's optimizer step per parameter of this rank's shard, as bytes at the GPU's bandwidth: FusedAdam
#: (bf16 weight and grad, fp32 master, m, v) and the flat-buffer copies, the norm and the clip around it.
#: The kernel alone moves fewer bytes; the step measured whole is what the plan must predict, so this is
#: fitted with SYNC_LAYER_PASS_S over the ZeRO-3 runs of both widths (bench/optimizer_refit.py; the
#: evidence: docs/planner.md "The optimizer step at both widths")
ADAM_BYTES_PER_PARAM = 80.0
#: what `overrides.optimizer_step=fused` takes off a ZeRO-1/2 step, per parameter and step, as bytes at the
#: GPU's bandwidth: DeepSpeed's norm copies each bf16 gradient to fp64 and reads that back (2 + 8 + 8
#: bytes; the fused step reads the 2 only), and its clip pass reads and writes the fp32 gradient (8). The
#: count, 24, is used rather than a fit because the measured savings straddle it (docs/planner.md "The
#: step-time model"). It is added to ZERO12_STEP_BYTES_PER_PARAM for DeepSpeed's own step. With
#: `training.grad_clip: 0` DeepSpeed skips its clip pass too and the saving is the norm's 16 bytes; the
#: model keeps 24 there (slightly over for such a step).
FUSED_STEP_SAVED_BYTES_PER_PARAM = 24.0
#: ZeRO-1/2's optimizer step with the fused AdamW kernel (`overrides.optimizer_step=fused`), per
#: parameter of this rank's shard, as bytes at the GPU's bandwidth: the kernel, the fp32 weights cast back
#: to bf16, the gradient scaling and the copies around them. Fitted with GPU_LAYER_PASS_UNHOOKED_S over the
#: one-GPU ZeRO-1/2 runs of both widths, because the step's per-step part is only separable from its
#: per-micro-step part by runs at two accumulation lengths (bench/optimizer_refit.py; docs/planner.md
#: "The optimizer step at both widths")
ZERO12_STEP_BYTES_PER_PARAM = 54.0
#: what the fused step's one pass (dskit/train/adamw_cast.py: the gradient read in 16 bits, AdamW, the
#: 16-bit weights written in the same kernel) takes off DeepSpeed's cast, fused AdamW and copy-back, per
#: parameter and step, as bytes at the GPU's bandwidth. Measured, not fitted: 21.81 against 11.51 ms for
#: 1.6 B parameters on the H200, (21.81 - 11.51) ms x 4.8 TB/s / 1.6e9 = 31 bytes
#: (bench/results/training/h200-adamw-cast-2026-12-04.json)
ONE_PASS_SAVED_BYTES_PER_PARAM = 31.0
#: ZeRO-1/2 copy every gradient a rank holds into a reduce bucket (bf16 read and written: 4 bytes) and
#: the rank's partition of it into the fp32 gradient the optimizer reads (2 read, 4 written: 6), stage 2
#: in every micro-step, stage 1 once per step. Counted, not fitted: the difference between stage 1 and
#: stage 2 at V3's width agrees with the count (docs/planner.md "The second gradient copy at the
#: accumulation boundary")
ZERO12_BUCKET_BYTES_PER_PARAM = 4.0
ZERO12_PARTITION_BYTES_PER_PARAM = 6.0
#: with more than one rank, GPU time per layer pass spent synchronising collectives (ZeRO-3 gathers
#: and reduce-scatters, AutoEP's count exchange and all-to-all launch), beyond their bandwidth time;
#: fitted with ADAM_BYTES_PER_PARAM (docs/planner.md "The optimizer step at both widths"), seconds
SYNC_LAYER_PASS_S = 0.0020

#: ZeRO-1/2 (no ZeRO-3 module hooks): host time per layer pass. The ZeRO-1/2 runs are GPU-bound or close
#: to it, which bounds this from above only: the largest value at which the host timeline predicts none
#: of those runs more than 2% slower than measured is taken (bench/optimizer_refit.py), so a host-bound
#: ZeRO-1/2 step is never predicted faster than it can be (docs/planner.md "The optimizer step at both
#: widths")
HOST_LAYER_PASS_UNHOOKED_S = 0.0065
#: ZeRO-1/2's GPU time per layer pass: below ZeRO-3's GPU_LAYER_PASS_S, which copies gathered weights
#: in and out; fitted with ZERO12_STEP_BYTES_PER_PARAM (it was set equal to ZeRO-3's while the ZeRO-1/2
#: optimizer was counted at 15 bytes, and absorbed the difference at V2-Lite's width)
GPU_LAYER_PASS_UNHOOKED_S = 0.0055
#: ZeRO-1/2 with each attention block compiled (one graph instead of ~30 eager launches per block): the
#: same kind of upper bound, from the host-bound runs that compiled them; where the GPU timeline alone is
#: already slower than measured, the host may not add to it (docs/planner.md "The optimizer step at both
#: widths")
HOST_LAYER_PASS_COMPILED_ATTENTION_S = 0.0055
#: ZeRO-1/2 with the fused step on one rank: host time per micro-step besides the layers. Nothing in its
#: micro-step waits for the GPU any more (DeepSpeed's overflow check read a flag back every step, and
#: overlap_comm, now off on one rank, synchronised the device per gradient bucket), so HOST_MICRO_STEP_S,
#: fitted on runs that paid both, overstates it. The same kind of upper bound as the layer passes': the
#: largest value on a 5 ms grid at which the host-bound 4-layer runs beside torchtitan (micro-batch 1 and
#: 2, seq 2048 and 4096) are predicted no more than 2% slower than measured. Several ranks keep
#: overlap_comm and its synchronisations, and no run there has measured this: they keep HOST_MICRO_STEP_S
#: (docs/planner.md "Small micro-steps")
HOST_MICRO_STEP_FUSED_S = 0.015
# AutoEP's fused top-k combine (dskit/plan/memory.py `fused_combine`) is measured faster than its eager
# weighted sum, in one call each: 9% at 65,536 tokens a micro-step on an H200 (43.8 ms a step,
# bench/results/peer/h200-vs-torchtitan-combine-2026-12-04.json), 9% at 32,768 on an H100 (23.5 ms,
# bench/results/training/h100-combine-s4096mb8-2026-12-06.json). The step-time model takes none of it off:
# its step, fitted on the eager sum at smaller micro-steps, predicts the fused runs at those sizes within
# 1% (five runs on two GPUs: those two, three of bench/calibrate_loop.py's on the H100; an H100 run of
# 2026-12-05 -5%, its GEMM probe 8% lower) and the eager ones 9-10% fast; taking the saving off
# made the fused predictions 10-15% fast. Its memory saving is counted (memory.py).

#: ZeRO-1/2 with its gradients flat on one rank (dskit/train/flat_grads.py): GPU and host time per layer
#: pass. The UNHOOKED constants were fitted on runs whose backward ran DeepSpeed's per-gradient hooks
#: (a Python call, a bucket copy and a partition copy per parameter) and absorbed them; here there are
#: none. The GPU's: the grid's smallest worst error over the runs beside torchtitan since the log records
#: went a step late (four H100 runs: 3-6 layers, micro-batch 1 and 2, seq 1024-4096; worst 1.7%); the runs
#: before it, which waited for the GPU at every log step, were fitted at 4 ms (bench/runs.py
#: GPU_LAYER_PASS_FLAT_SYNCED_S: the waits' idle GPU in it). The host's: the same kind of upper bound as
#: the other host constants, over both, with attention compiled (the GPU default; no flat run had it
#: eager, which keeps HOST_LAYER_PASS_UNHOOKED_S). Both by bench/optimizer_refit.py (docs/planner.md
#: "Small micro-steps")
GPU_LAYER_PASS_FLAT_S = 0.00275
HOST_LAYER_PASS_FLAT_S = 0.0035
#: one rank's fused bf16 step (`one_rank_fused`) reads nothing back from the GPU, and since the trainer
#: writes a GPU's log record a step late (dskit/train/metrics.py `LogWindow`) nothing else in a step does
#: (bench/sync_sites.py: 0.15 synchronising calls a step, all before the first): the host queues the next
#: step's forward while the GPU still runs this step's optimizer, so the optimizer is on the GPU timeline,
#: step = max(GPU + optimizer, host). Runs measured before it waited for the GPU at every log step (the
#: benches log every step) and are re-predicted as such (bench/runs.py `as_measured`)
OPTIMIZER_OVERLAPS_NEXT_STEP = True

#: LoRA on a frozen base (finetune.method lora): the step's FLOPs (4 per active frozen weight, 6 per
#: trainable one: dskit/plan/adapters.py) take this much longer than GEMM_EFFICIENCY says (each adapted
#: linear adds memory-bound passes over its input and output: A's input read again, B's output scaled
#: and added, their gradients; the frozen GEMMs' input-gradient-only backward), and a layer pass this
#: fraction of its stage's per-pass cost (no weight gradients to copy into ZeRO's buckets). Both fitted
#: to the LoRA runs (without them the plan was consistently fast), the layer-pass factor refitted with
#: ZeRO-1/2's own per-pass cost (bench/optimizer_refit.py); the runs, the errors and the held-out pick:
#: docs/planner.md "LoRA"
LORA_COMPUTE_FACTOR = 1.34
LORA_LAYER_PASS_FACTOR = 0.55
# An FP8 base (dskit/train/fp8/blocks.py `dequantize_blocks`, plain torch per 128 x 128 block) dequantises
# every FP8 weight a rank holds in each forward and again in each backward: memory traffic, not FLOPs
# (e4m3 read, float32 blocks written and scaled, bf16 written). Bytes of traffic per weight and pass at
# the catalog's HBM bandwidth, fitted on the FP8-base LoRA runs (docs/planner.md "LoRA").
FP8_DEQUANT_BYTES_PER_WEIGHT = 33.0

# ---- first principles, cited ----
#: DeepSpeed's CPU Adam, core-seconds per billion parameters: each rank steps its offloaded optimizer on
#: its own OMP_NUM_THREADS cores (`host.threads_per_rank`), so the rate scales with the cores a rank gets.
#: Fitted on offloaded runs beside the same runs resident, on one host's cores only: the host's rate is
#: the least certain term here (the search keeps offload last in a tie for it). The ZeRO-Offload paper's
#: per-node rate, which it replaced, ignored the cores and was far too fast (docs/planner.md "Optimizer
#: offload, measured").
CPU_ADAM_CORE_S_PER_BPARAM = 14.7
#: offload traffic per parameter and step: fp32 gradient to the host, bf16 weight back, at the
#: accumulation boundary. Not counted: DeepSpeed 0.19.8 also keeps the 16-bit gradient partitions in a
#: pinned host buffer (stage3.py `partition_grads`: copied there in the first micro-step, brought back,
#: added and copied again in each later one), 2-6 bytes per micro-step; the fitted CPU Adam rate absorbs
#: it (docs/planner.md "Optimizer offload, measured")
OFFLOAD_BYTES_PER_PARAM = 6
#: AutoEP's fixed cost per dispatch-and-combine pair beyond NCCL's per-call latency, seconds: the count
#: exchange before each dispatch, the split sizes read back to the host (which stalls its launches) and
#: the permutes' kernel launches. Its bytes run at the catalog's all-to-all rate (links.A2A_LINK_SHARE of
#: NVLink's line rate, NCCL's reach): the single share of the link fitted before (0.4) folded this cost
#: into the bandwidth and so charged large messages for it 2.5x over at V3's width. Fitted by
#: bench/a2a_fit.py on the 2 x H200 EP 2 runs beside EP 1 (docs/planner.md "Validation on H200");
#: a measured exchange (`dskit calibrate`) already holds it and takes none
A2A_PAIR_FIXED_S = 0.00225
#: share of the compute term that regional torch.compile (dskit/train/compile.py) removes: its fused
#: RMSNorm, SwiGLU and rotary kernels replace eager elementwise kernels that GEMM_EFFICIENCY absorbs.
#: Measured where the step is GPU-bound; the host timeline is unchanged. Other models and GPUs are assumed
#: to gain the same share (V3's larger GEMMs and eager rotary likely gain less): docs/planner.md "The
#: step-time model".
COMPILED_COMPUTE_SAVING = 0.10
#: share of the (already compiled-regions) compute term that compiling each whole attention block takes
#: off besides, measured where the step is GPU-bound (docs/planner.md "The step-time model")
COMPILED_ATTENTION_SAVING = 0.035
#: 16-bit weights and gradients
WIRE_BYTES = 2

# ---- CPU ranks (the cpu profile: DeepSpeed's CPU accelerator, gloo), `_cpu_step` ----
# A CPU rank runs its kernels on its own thread, so the host's timeline and the device's add rather than
# overlap, and nothing hides a collective. A CPU has no catalog peak, so a CPU plan predicts only with a
# calibration. These constants were fitted on this project's 2-core development machine (the CPU
# reference machine of dskit/calibrate/scales.py), 2 ranks of the tiny models over loopback, by
# bench/cpu_fit.py (its runs and errors: docs/planner.md "CPU ranks"), and another host's probes scale
# them: the compute too by the host probe, not the GEMM probe (whose rate is the plan's MFU peak), since
# the tiny models' small kernels are bound by per-operation overhead: an AMD host whose GEMM probe read
# 0.2x the Intel reference's (no AMX) trained them as fast, its host probe reading 0.96x.
#: the model's FLOPs per second on the CPU reference machine, TFLOP/s
CPU_COMPUTE_TFLOPS = 0.014
#: host time per layer pass under ZeRO-3 (its module hooks and partitioned-parameter bookkeeping), s
CPU_HOST_LAYER_PASS_S = 0.008
#: host time per layer pass under ZeRO-1/2, s
CPU_HOST_LAYER_PASS_UNHOOKED_S = 0.0025
#: AutoEP's routing at EP > 1 beyond its measured exchange (permutes by destination and local expert,
#: its bookkeeping), per MoE layer pass, s
CPU_EP_LAYER_PASS_S = 0.002
#: host time per optimizer step besides the update's arithmetic (the engine's step: ZeRO's partition
#: bookkeeping, gradient clipping's norm, the scheduler), s: ZeRO-3's, and ZeRO-1/2's
CPU_HOST_OPTIMIZER_STEP_S = 0.0255
CPU_HOST_OPTIMIZER_STEP_UNHOOKED_S = 0.011
#: a CPU rank's optimizer step (torch's AdamW over its shard, fp32 master and moments), core-seconds per
#: billion parameters: DeepSpeed's CPU Adam probe reads about this on the CPU reference machine
CPU_ADAM_CORE_S_PER_BPARAM_CPU = 1.3
GB = 1e9


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds per optimizer step, by term (all per GPU)."""

    compute_s: float  # GPU timeline: FLOPs at GEMM_EFFICIENCY
    layer_gpu_s: float  # GPU timeline: per layer pass beyond FLOPs
    collectives_s: float  # GPU timeline: ZeRO-3 gathers/reduce-scatters (exposed) and their synchronisation
    grad_copy_s: float  # GPU timeline: ZeRO-2's gradient copies into buckets and partitions
    all_to_all_s: float  # GPU timeline: AutoEP dispatch and combine
    host_s: float  # host timeline: hooks and launches, overlapped with the GPU's
    optimizer_s: float
    tokens_per_step: int  # per GPU
    flops_per_token: float
    peak_tflops: float
    unknown: tuple[str, ...]  # terms left out for want of a bandwidth (named in --explain)
    #: ZeRO-1/2, once per step after the backward, not overlapped: collectives and ZeRO-1's copies
    boundary_s: float = 0.0
    #: (term, where its rate comes from: measured on this cluster, fitted on the bench, the catalog)
    sources: tuple[tuple[str, str], ...] = ()
    #: a device that runs its kernels on the host's thread (CPU ranks): the two timelines add
    synchronous: bool = False
    #: nothing waits for the optimizer's kernels: they run on the GPU timeline while the host queues the
    #: next step (OPTIMIZER_OVERLAPS_NEXT_STEP)
    optimizer_overlapped: bool = False

    @property
    def micro_gpu_s(self) -> float:
        """The micro-steps' GPU timeline, without the optimizer."""
        return self.compute_s + self.layer_gpu_s + self.collectives_s + self.grad_copy_s + self.all_to_all_s

    @property
    def gpu_s(self) -> float:
        """The GPU timeline the host runs beside: the micro-steps, and the optimizer where it overlaps."""
        return self.micro_gpu_s + (self.optimizer_s if self.optimizer_overlapped else 0.0)

    @property
    def bound(self) -> str:
        """Which timeline sets the pace of the micro-steps (both, one after the other, on a CPU rank)."""
        if self.synchronous:
            return "host + device"
        return "host" if self.host_s > self.gpu_s else "GPU"

    @property
    def step_s(self) -> float:
        both = self.gpu_s + self.host_s if self.synchronous else max(self.gpu_s, self.host_s)
        return both + (0.0 if self.optimizer_overlapped else self.optimizer_s) + self.boundary_s

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
        d["bound"] = self.bound
        if self.optimizer_overlapped:  # step_s is max(GPU + optimizer, host) + boundary
            d["optimizer_overlapped"] = True
        d["tokens_per_s_per_gpu"] = round(self.tokens_per_s)
        d["mfu"] = round(self.mfu, 4)
        if self.unknown:
            d["not_counted"] = list(self.unknown)
        if self.sources:
            d["sources"] = dict(self.sources)
        return d


def checkpointed_fraction(layers: int, ckpt_every: int) -> float:
    """Share of layers recomputed in backward (dskit/train/model.py checkpoints layer i when i % N == 0)."""
    return 0.0 if not ckpt_every else math.ceil(layers / ckpt_every) / layers


@dataclass(frozen=True)
class Passes:
    """A micro-step's decoder-layer passes: forward, backward, and the forward again of the checkpointed
    layers (`frac` of them)."""

    layers: int
    moe_layers: int
    frac: float  # checkpointed_fraction

    @classmethod
    def of(cls, s: ModelShape, ckpt_every: int) -> Passes:
        return cls(s.layers, s.moe_layers, checkpointed_fraction(s.layers, ckpt_every))

    @property
    def total(self) -> float:
        return self.layers * (2 + self.frac)

    @property
    def by_group(self) -> dict[str, int]:
        """The layers whose weights each ZeRO group holds: every layer for the dense group, the MoE
        layers for the expert-data-parallel one (`_zero_groups`' names)."""
        return {"dense": self.layers, "expert_dp": self.moe_layers}


def predict(
    w: Workload, cand: Candidate, cluster: Cluster, links: Links, scales: Scales | None = None
) -> StepTime | None:
    """Predicted step time of `cand`, or None where nothing gives a compute rate to scale from (a GPU
    without a catalog peak; CPU ranks without a calibration: `_cpu_step`). An offloaded optimizer steps
    on the host's CPU Adam, on `cluster.host_threads` cores per rank. A LoRA run (`w.tuning`) has its own
    FLOPs per token (`Tuning.flops_per_token`). `links`: the cluster's collective rates
    (dskit/plan/links.py). `scales`: a calibration's factors on the fitted terms (dskit/calibrate/scales.py)."""
    scales = scales or Scales()
    gpu, peak_tflops = cluster.gpu, cluster.peak_tflops
    if gpu.is_cpu:
        return _cpu_step(w, cand, cluster, links, scales)
    if peak_tflops is None or gpu.memory_bw_gbs is None:
        return None
    c, tuning, layout = w.counts, w.tuning, cluster.layout(cand)
    zero_stage, grad_accum = cand.zero_stage, w.grad_accum(cand)
    T = w.tokens(cand)
    passes = Passes.of(w.shape, cand.ckpt_every)
    frac = passes.frac
    unknown: list[str] = []  # filled by the terms that need a bandwidth the catalog lacks

    attention = w.compiled_attention and zero_stage < 3  # the plan's compile_attention
    fwd = None if tuning is None else tuning.forward_share(c)
    flops = _scaled_flops(c, w.flops_per_token, scales)
    if w.fp8 is not None:  # the FP8 products at their measured speed-up (dskit/plan/fp8_training.py)
        flops -= w.fp8.flops_saved_per_token * scales.compute
    compute = _compute_s(T, flops, frac, peak_tflops * 1e12, w.compiled, fwd, attention)
    if tuning is not None:  # before the windows ZeRO's transfers hide behind: LoRA's compute is longer
        compute *= LORA_COMPUTE_FACTOR
    groups = _zero_groups(w.shape, c, layout, tuning)
    shapes = links_.groups(layout.world, layout.per_node, layout.ep_size)
    per_micro, per_step = _collectives_s(
        groups,
        shapes,
        links,
        zero_stage,
        passes,
        compute_windows(compute, frac, fwd),
        prefetched(c, layout),
        unknown,
    )
    per_micro += _sync_s(shapes, zero_stage, passes, links)
    a2a = _all_to_all_s(w.shape, shapes["ep"], links, T, frac, unknown)
    hooked = zero_stage == 3
    host_pass = (
        HOST_LAYER_PASS_S
        if hooked
        else HOST_LAYER_PASS_COMPILED_ATTENTION_S
        if attention
        else HOST_LAYER_PASS_UNHOOKED_S
    )
    # bf16's fused step on one rank reads nothing back, and its gradients go flat: no per-gradient hook,
    # no copy (fp16 keeps DeepSpeed's overflow check, offload and several ranks overlap_comm's
    # synchronisations and the reduce path: dskit/plan/deepspeed.py, dskit/train/flat_grads.py)
    unsynced = one_rank_fused(layout.world, zero_stage, cand.offload, w.fused_step, w.precision)
    flat = flat_gradients(layout.world, zero_stage, cand.offload, w.fused_step, w.precision)
    gpu_pass = GPU_LAYER_PASS_S if hooked else GPU_LAYER_PASS_FLAT_S if flat else GPU_LAYER_PASS_UNHOOKED_S
    if flat and attention:  # measured only with attention compiled, the GPU default; eager keeps its bound
        host_pass = HOST_LAYER_PASS_FLAT_S
    micro_host = HOST_MICRO_STEP_FUSED_S if unsynced else HOST_MICRO_STEP_S
    dequant = grad_copy = 0.0
    # stage 2 copies each micro-step's gradients, stage 1 the accumulated ones once; flat ones are not copied
    if zero_stage < 3 and not flat:
        copy = _grad_copy_s(*_trained_grads(c, layout, tuning), layout, gpu)
        if zero_stage == 2:
            grad_copy = grad_accum * copy
        else:  # after the last backward, with nothing left to hide it behind: exposed, as its reduce
            per_step += copy
    if tuning is not None:
        gpu_pass *= LORA_LAYER_PASS_FACTOR
        weights = tuning.fp8_weights_local(layout.ep_size)  # forward, backward, recomputed forwards
        dequant = (2 + frac) * weights * FP8_DEQUANT_BYTES_PER_WEIGHT / (gpu.memory_bw_gbs * GB)
    return StepTime(
        # the combine's passes scale with the tokens, as the FLOPs do: the fitted step matches the fused
        # combine's runs from 32,768 tokens; the eager one's there (several ranks) come out 9-10% fast
        compute_s=grad_accum * compute,
        # the per-layer GPU work: launches and small kernels per layer pass, and an FP8 base's dequantising
        layer_gpu_s=grad_accum * (gpu_pass * passes.total + dequant),
        collectives_s=grad_accum * per_micro,
        grad_copy_s=grad_copy,
        all_to_all_s=grad_accum * a2a,
        host_s=grad_accum * scales.host * (host_pass * passes.total + micro_host),
        optimizer_s=_optimizer_s(
            c.total if tuning is None else tuning.trainable,
            layout,
            gpu,
            cand.offload,
            zero_stage,
            w.fused_step,
            cluster.host_threads,
            CPU_ADAM_CORE_S_PER_BPARAM * scales.cpu_adam,
        ),
        tokens_per_step=grad_accum * T,
        flops_per_token=w.flops_per_token,
        peak_tflops=peak_tflops,
        unknown=tuple(dict.fromkeys(unknown)),
        boundary_s=per_step,
        sources=(*_link_sources(shapes, links), *scales.sources.items()),
        optimizer_overlapped=unsynced and OPTIMIZER_OVERLAPS_NEXT_STEP,
    )


def _cpu_step(
    w: Workload, cand: Candidate, cluster: Cluster, links: Links, scales: Scales
) -> StepTime | None:
    """A CPU rank's step (the "CPU ranks" constants above): the same terms as a GPU's (compute, layer
    passes, ZeRO's collectives, AutoEP's exchange, the optimizer, ZeRO-1/2's boundary), but the host
    and device timelines add and no collective is hidden. None without a measured GEMM rate."""
    if not scales.gemm_tflops:
        return None
    c, tuning, layout = w.counts, w.tuning, cluster.layout(cand)
    zero_stage, grad_accum = cand.zero_stage, w.grad_accum(cand)
    T = w.tokens(cand)
    passes = Passes.of(w.shape, cand.ckpt_every)
    frac = passes.frac
    unknown: list[str] = []
    fwd = None if tuning is None else tuning.forward_share(c)
    compute = _compute_s(
        T, w.flops_per_token, frac, CPU_COMPUTE_TFLOPS * 1e12 / scales.compute, False, fwd, efficiency=1.0
    )
    shapes = links_.groups(layout.world, layout.per_node, layout.ep_size)
    per_micro, per_step = _collectives_s(
        _zero_groups(w.shape, c, layout, tuning),
        shapes,
        links,
        zero_stage,
        passes,
        (0.0, 0.0, 0.0),  # nothing runs beside a CPU rank's compute to hide them
        1.0,
        unknown,
    )  # and no fitted synchronisation (_sync_s): the calls' latencies are measured
    a2a = _all_to_all_s(w.shape, shapes["ep"], links, T, frac, unknown)
    hooked = zero_stage == 3
    host = (CPU_HOST_LAYER_PASS_S if hooked else CPU_HOST_LAYER_PASS_UNHOOKED_S) * passes.total
    if layout.ep_size > 1:
        host += CPU_EP_LAYER_PASS_S * c.moe_layers * (2 + frac)
    optimized = (c.total if tuning is None else tuning.trainable) / layout.world
    return StepTime(
        compute_s=grad_accum * compute,
        layer_gpu_s=0.0,
        collectives_s=grad_accum * per_micro,
        grad_copy_s=0.0,
        all_to_all_s=grad_accum * a2a,
        host_s=grad_accum * scales.host * host,
        optimizer_s=optimized / 1e9 * CPU_ADAM_CORE_S_PER_BPARAM_CPU * scales.cpu_adam / cluster.host_threads
        + scales.host * (CPU_HOST_OPTIMIZER_STEP_S if hooked else CPU_HOST_OPTIMIZER_STEP_UNHOOKED_S),
        tokens_per_step=grad_accum * T,
        flops_per_token=w.flops_per_token,
        peak_tflops=scales.gemm_tflops,
        unknown=tuple(dict.fromkeys(unknown)),
        boundary_s=per_step,
        sources=(*_link_sources(shapes, links), *scales.sources.items()),
        synchronous=True,
    )


def _link_sources(shapes: dict[str, links_.Group], links: Links) -> list[tuple[str, str]]:
    """Where each group's collective rate came from: measured on this cluster or the catalog."""
    out = []
    for name in ("dense", "expert_dp"):
        g = shapes[name]
        r = links.rate("all_gather", g) if g.size > 1 else None
        if r is not None:
            out.append((f"{name.replace('_', '-')} group ({g.describe()})", r.source))
    g = shapes["ep"]
    if g.size > 1:
        measured = links.exchange(g)
        r = links.rate("all_to_all", g)
        if measured is not None:
            out.append((f"ep group ({g.describe()})", f"{measured.source}: AutoEP's dispatch and combine"))
        elif r is not None:
            out.append(
                (
                    f"ep group ({g.describe()})",
                    f"{r.source}; AutoEP's fixed cost per dispatch and combine (A2A_PAIR_FIXED_S) {FITTED}",
                )
            )
    return out


def _trained_grads(c: ModelCounts, layout: Layout, t: Tuning | None) -> tuple[float, float]:
    """The gradients a rank holds: (reduced over all ranks, its routed experts' share), of every
    parameter or of a LoRA run's trainable ones."""
    if t is None:
        experts = c.experts_per_layer * c.moe_layers
        return c.total - experts, experts / layout.ep_size
    return t.trainable - t.routed_adapters, t.routed_adapters / layout.ep_size


def _scaled_flops(c: ModelCounts, flops_per_token: float, scales: Scales) -> float:
    """FLOPs per token, the attention's (scores and values) scaled by the attention probe and the rest
    by the GEMM probe (dskit/calibrate/scales.py): each at this cluster's rate relative to the reference."""
    attention = min(c.attn_flops_per_token, flops_per_token)
    return (flops_per_token - attention) * scales.compute + attention * scales.attention


def _compute_s(
    tokens: int,
    flops_per_token: float,
    frac: float,
    peak: float,
    compiled: bool,
    forward_share: float | None = None,
    attention: bool = False,
    *,
    efficiency: float = GEMM_EFFICIENCY,
) -> float:
    """One micro-step's FLOPs at GEMM_EFFICIENCY of `peak` FLOP/s, the recomputed forwards included:
    `forward_share` of the FLOPs each (None: a third, full training's forward of fwd 2 + bwd 4)."""
    recompute = 1 + frac / 3 if forward_share is None else 1 + frac * forward_share
    compute = tokens * flops_per_token * recompute / (peak * efficiency)
    if compiled:
        compute *= 1 - COMPILED_COMPUTE_SAVING
    if attention:
        compute *= 1 - COMPILED_ATTENTION_SAVING
    return compute


def _zero_groups(
    s: ModelShape, c: ModelCounts, layout: Layout, t: Tuning | None
) -> tuple[tuple[float, float, str], ...]:
    """ZeRO's traffic per group: (bytes gathered per layer pass under ZeRO-3, bytes reduced per
    micro-step and, under ZeRO-1/2, all-gathered once per step, the group: `links.groups`' name). Experts are sharded
    over the expert-data-parallel group, the rest over all ranks. AutoEP's groups: EP = consecutive
    ranks (inside a node when ep <= per_node); the expert-data-parallel group strides by ep over all
    ranks, so it spans every node, as the dense group does. ZeRO-3 gathers no tensor at or below its
    persistence threshold (prefetch.PERSISTENCE_THRESHOLD: kept whole on every rank), though its
    gradient is reduced like any other. A LoRA run (`t`) still gathers every frozen weight per pass under
    ZeRO-3 (in the base's precision), but reduces only the trainable parameters (the dense group;
    routed-expert adapters the expert-data-parallel group)."""
    dense, routed = (WIRE_BYTES * n for n in _trained_grads(c, layout, t))
    if t is None:  # every weight is trained: gathered (what is not persistent) and reduced alike
        sizes = model_math.tensor_sizes(s)
        kept = PERSISTENCE_THRESHOLD
        gathered_dense = (
            c.dense_layers * model_math.gathered(sizes["dense_layer"], kept)
            + c.moe_layers * model_math.gathered(sizes["moe_layer"], kept)
            + model_math.gathered(sizes["outer"], kept)
        )
        local_experts = [n // layout.ep_size for n in sizes["experts"]]
        gathered_routed = c.moe_layers * model_math.gathered(local_experts, kept)
        return (WIRE_BYTES * gathered_dense, dense, "dense"), (
            WIRE_BYTES * gathered_routed,
            routed,
            "expert_dp",
        )
    trained = dense  # the routed adapters are reduced over the experts' own group
    return (
        (t.other_bytes * t.frozen_other + trained, trained, "dense"),
        (t.expert_bytes * t.frozen_experts / layout.ep_size + routed, routed, "expert_dp"),
    )


def prefetched(c: ModelCounts, layout: Layout) -> float:
    """The share of a MoE layer ZeRO-3 gathers ahead, behind the compute of the layer before it, under
    the rendered live-parameter limit (dskit/plan/prefetch.py: the config's limit comes from the same
    function, sized by the largest gathered unit); the rest is gathered when its layer starts, exposed.
    The MoE layers are the passes that repeat: where the largest unit is another (the embedding, at an
    EP size that leaves no expert gathered), the limit it sets leaves a MoE layer more room, not less."""
    live = max_live(gathered_layer_params(c, layout.world, layout.ep_size))
    if c.moe_layers == 0:
        return prefetched_share(live, c.largest_layer)
    routed = c.experts_per_layer // layout.ep_size if layout.world // layout.ep_size > 1 else 0
    return prefetched_share(live, c.moe_layer_non_expert + routed)


def compute_windows(compute: float, frac: float, forward_share: float | None) -> tuple[float, float, float]:
    """One micro-step's compute seconds by pass, (forward, backward, recomputed forwards): what ZeRO's
    collectives of that pass can run behind. `forward_share`: of a training pass's FLOPs (None: a
    third, full training's forward of fwd 2 + bwd 4)."""
    f = 1 / 3 if forward_share is None else forward_share
    whole = 1 + frac * f
    return compute * f / whole, compute * (1 - f) / whole, compute * frac * f / whole


def _exposed(comm: float, window: float, share: float = 1.0, free: float = 0.0) -> float:
    """Seconds of `comm` and `free` not hidden behind `window` of compute: of `comm` only `share` could
    start ahead (a gather the live limit holds back waits for its layer), `free` whenever it is ready."""
    return comm * (1 - share) + max(0.0, comm * share + free - window)


def _collectives_s(
    groups: tuple[tuple[float, float, str], ...],
    shapes: dict[str, links_.Group],
    links: Links,
    zero_stage: int,
    passes: Passes,
    windows: tuple[float, float, float],
    share: float,
    unknown: list[str],
) -> tuple[float, float]:
    """ZeRO's collective seconds (every micro-step, once per optimizer step) for `_zero_groups`' traffic,
    their fitted synchronisation not included (`_sync_s`); a group whose rate is unknown is named in
    `unknown` and not counted. ZeRO-3 gathers each layer once per pass and reduce-scatters each layer's
    gradients once per micro-step (one call each, for the latency), over the layers whose weights the
    group holds (`Passes.by_group`). Each
    pass's collectives, over both groups, run behind that pass's compute (`windows`: `compute_windows`;
    zeros where nothing runs beside them, a CPU rank), ZeRO-3's gathers only for the `share` its
    prefetch limits fetch ahead (`prefetched`); the reduce-scatters (ZeRO-2's and ZeRO-3's) behind the
    backward, whole: DeepSpeed issues them on its reduce stream as the gradients come (`overlap_comm`),
    which no live limit holds back. What the compute cannot hide is exposed."""
    frac, layers = passes.frac, passes.by_group
    per_step = 0.0
    by_pass = [0.0, 0.0, 0.0]  # ZeRO-3's gathers by pass: forward, backward, recompute
    reduce = 0.0  # the backward's reduce-scatters
    for gathered, reduced, name in groups:
        g = shapes[name]

        def t(op: str, nbytes: float, calls: float = 1.0, g: links_.Group = g) -> float:
            return links.seconds(op, g, nbytes, calls) or 0.0

        if g.size > 1 and any(links.rate(op, g) is None for op in ("all_gather", "reduce_scatter")):
            unknown.append(f"ZeRO-{zero_stage} collectives across nodes (fabric bandwidth unknown)")
            continue
        calls = layers[name]  # the layers whose weights the group holds: every layer, or the MoE ones
        if zero_stage == 3:  # a gather per layer and pass, one gradient reduce-scatter per micro-step
            gather = t("all_gather", gathered, calls)
            by_pass[0] += gather
            by_pass[1] += gather
            by_pass[2] += t("all_gather", gathered * frac, calls * frac) if frac else 0.0
            reduce += t("reduce_scatter", reduced, calls)
        else:  # the updated weights all-gathered once per step, exposed
            per_step += t("all_gather", reduced)
            if zero_stage == 2:  # reduce-scattered as the backward produces the gradients
                reduce += t("reduce_scatter", reduced, calls)
            else:  # stage 1 reduces at the accumulation boundary, after the backward: exposed
                per_step += t("reduce_scatter", reduced)
    frees = (0.0, reduce, 0.0)
    per_micro = sum(
        _exposed(comm, w, share, free) for comm, w, free in zip(by_pass, windows, frees, strict=True)
    )
    return per_micro, per_step


def _sync_s(
    shapes: dict[str, links_.Group],
    zero_stage: int,
    passes: Passes,
    links: Links,
    sync_layer_pass_s: float = SYNC_LAYER_PASS_S,
) -> float:
    """A micro-step's synchronisation beyond its collectives' bandwidth time, per layer pass: ZeRO-3's
    gathers and reduce-scatters with more than one rank, else AutoEP's count exchange with EP > 1, unless
    `dskit calibrate` measured the exchange, whose pairs then hold it (`_all_to_all_s`). A GPU step's
    (SYNC_LAYER_PASS_S, fitted); a CPU step adds none (its calls' latencies are measured)."""
    if zero_stage == 3:
        syncs = shapes["dense"].size > 1
    else:
        syncs = shapes["ep"].size > 1 and links.exchange(shapes["ep"]) is None
    return sync_layer_pass_s * passes.total if syncs else 0.0


def _all_to_all_s(
    s: ModelShape,
    ep: links_.Group,
    links: Links,
    tokens: int,
    frac: float,
    unknown: list[str],
) -> float:
    """One micro-step's AutoEP dispatch and combine seconds (0 without EP, or where the rate is
    unknown: then named in `unknown`): a dispatch-and-combine pair per MoE layer and pass (forward,
    backward, a recomputed forward). Measured by `dskit calibrate` (AutoEP's own exchange: its count
    exchange, split sizes read back and uneven all-to-alls), the pair takes what was measured; else
    the bytes at the all-to-all's rate (the catalog's: NCCL's share of the links) plus AutoEP's fitted
    fixed cost per pair (A2A_PAIR_FIXED_S), which a measurement already holds and is not added again."""
    if ep.size == 1:
        return 0.0
    pairs = s.moe_layers * (2 + frac)
    both_ways = 2 * tokens * s.active_experts * s.hidden * WIRE_BYTES
    sent = both_ways * links_.moved_share("all_to_all", ep.size)
    measured = links.exchange(ep)
    if measured is not None:
        return pairs * (measured.latency_s + sent / (measured.bus_gbs * GB))
    rate = links.rate("all_to_all", ep)
    if rate is None:
        unknown.append("all-to-all across nodes (fabric bandwidth unknown)")
        return 0.0
    return pairs * (A2A_PAIR_FIXED_S + 2 * rate.latency_s + sent / (rate.bus_gbs * GB))


def _optimizer_s(
    optimized: int,
    layout: Layout,
    gpu: GPU,
    offload: bool,
    zero_stage: int = 3,
    fused: bool = False,
    host_threads: int = 8,
    cpu_adam_core_s: float = CPU_ADAM_CORE_S_PER_BPARAM,
) -> float:
    """Adam over this rank's shard of every trained parameter (`optimized`: all of them, or a LoRA
    run's trainable ones): GPU memory bandwidth, or with offload the host's CPU Adam on the rank's
    `host_threads` cores plus the PCIe round trip of gradients and weights. ZeRO-1/2 step at their own
    rate; `fused`: without DeepSpeed's clip and fp64-norm passes, its cast and copy-back folded into AdamW."""
    local_params = optimized / layout.world  # every stage shards the optimizer states
    if offload:
        pcie = gpu.pcie_gbs or gpu.interconnect_gbs or 1.0
        return (
            local_params / 1e9 * cpu_adam_core_s / host_threads
            + local_params * OFFLOAD_BYTES_PER_PARAM / (pcie * GB)
        )
    if zero_stage == 3:
        return local_params * ADAM_BYTES_PER_PARAM / (gpu.memory_bw_gbs * GB)
    # DeepSpeed's own step: its clip and fp64-norm passes; the fused one: one pass where it makes three
    per_param = ZERO12_STEP_BYTES_PER_PARAM + (
        -ONE_PASS_SAVED_BYTES_PER_PARAM if fused else FUSED_STEP_SAVED_BYTES_PER_PARAM
    )
    return local_params * per_param / (gpu.memory_bw_gbs * GB)


def _grad_copy_s(dense: float, routed: float, layout: Layout, gpu: GPU) -> float:
    """ZeRO-1/2's copies of this rank's gradients (`dense`: reduced over all ranks; `routed`: its
    experts', over the expert-data-parallel group) into the reduce buckets, and of its partition of them
    into the 32-bit gradient that the optimizer steps on."""
    partition = dense / layout.world + routed / layout.expert_dp
    copied = (dense + routed) * ZERO12_BUCKET_BYTES_PER_PARAM + partition * ZERO12_PARTITION_BYTES_PER_PARAM
    return copied / (gpu.memory_bw_gbs * GB)
