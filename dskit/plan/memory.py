"""Per-GPU memory estimate for ZeRO (stage 1, 2 or 3) + AutoEP training of a DeepSeek MoE.

An estimate, not a promise: tests/plan/test_plan_calibration.py keeps it within 10% of the peak the
allocator reserved on every H200 run of bench/results/planner/h200*-planner-*.json. What it counts:

- model states: mixed-precision Adam keeps 16 bytes per parameter (bf16 weight + bf16 grad + fp32
  master, momentum, variance; ZeRO paper, Rajbhandari et al. 2020). ZeRO-3 shards non-expert states over
  all ranks; AutoEP gives each rank 1/ep of the experts and ZeRO-3 shards those over the expert-data-
  parallel group (world/ep), so both come to 16 * P / world per GPU. Optimizer offload moves the 12
  fp32 bytes to host memory, and the 16-bit gradients with them (`gpu_state_bytes`).
- ZeRO-1 and 2 (`zero_stage`) keep this rank's 16-bit weights whole: every non-expert parameter and
  1/ep of the experts, 2 bytes each. Stage 2 shards the 16-bit gradients over the data-parallel group
  like the fp32 states; stage 1 keeps them whole until the accumulation boundary. The fp32 master,
  momentum and variance (12 bytes) are sharded in both (DeepSpeed 0.19.8 stage_1_and_2.py: the flat
  bf16 gradient partition, `single_partition_of_fp32_groups`, the Adam states). At one rank the states
  equal ZeRO-3's, and ZeRO-3's gathered layers are the difference (docs/planner.md "ZeRO stages").
- ZeRO-1/2 with gradient accumulation hold a second 16-bit copy of the rank's gradient partition in
  the boundary micro-step's backward, while its activations are alive (`boundary_grad_copy`).
- the gathered working set: ZeRO-3 materialises about two layers' bf16 weights at once (the current and
  the prefetched one), plus gradient buckets. A MoE layer's local experts (1/ep of them) are part of
  its gathered weights whenever ZeRO-3 shards them, i.e. when the expert-data-parallel group
  (world / ep) has more than one rank: for V3 at EP 8 that is 32 experts, 2.6 GiB a layer.
- activations: bytes saved per token per layer for backward, from the shapes of every tensor autograd
  keeps (inputs of each linear, of the activation function and of the norms), in bf16; with activation
  checkpointing only each checkpointed layer's input is kept, plus one layer being recomputed.
- regional torch.compile (`dskit/train/compile.py`) keeps less: eager RMSNorm saves an fp32 copy of its
  input for backward and eager SwiGLU the SiLU output; fused, they recompute both from what the
  neighbouring linears keep anyway (`compiled_saving_per_token_layer`).
- the loss: bf16 logits, their fp32 copy for the softmax and its gradient (batch x seq x vocab); at
  V2's 102400 vocabulary this is the largest activation.
- a fixed overhead for the CUDA context, NCCL buffers and allocator fragmentation.

`construction_gib` is the other GPU peak: building the model partitioned from birth (ZeRO-3
`zero.Init`), before the optimizer exists. Host RAM is in `dskit/plan/host_memory.py`; what "fits" means, and
the error when nothing does, in `dskit/plan/fit.py`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dskit.plan.adapters import BF16_BYTES, Tuning
from dskit.plan.candidate import Candidate, Cluster, Workload
from dskit.plan.model_math import ModelCounts
from dskit.plan.prefetch import gathered_layer_params
from dskit.plan.shape import ModelShape

GIB = 2**30
OVERHEAD_GIB = 2.5
# Measured peak / counted activation bytes on the H200 baseline (allocator slack, temporaries such
# as the all-to-all dispatch buffers and attention workspaces), fitted on the eager ZeRO-3 runs that
# tests/plan/test_plan_calibration.py re-checks.
ACTIVATION_SLACK = 1.5


# Construction (partitioned from birth under deepspeed.zero.Init; AutoEP then re-partitions the routed
# experts one MoE layer at a time, DeepSpeed PR #8424). First-principles numbers, checked against the
# peaks the trainer measured with the full V2-Lite on two GPUs (docs/planner.md "The model's constants
# and their evidence"; tests/plan/test_plan_fit.py keeps the estimate above the measurement):
#   each rank keeps its 1/world of the 16-bit weights;
#   the largest single module is gathered whole while it is initialised (or loaded): for a MoE layer
#   all its routed experts (transformers holds them as two fused tensors), e.g. DeepSeek-V3:
#   256 x 3 x 7168 x 2048 x 2 B = 22.5 GB (21.0 GiB);
#   AutoEP copies that layer's local experts (1/ep of them) out of the gathered tensors before the full
#   ones are freed, so both are alive at once;
#   the CUDA context and NCCL buffers (OVERHEAD_GIB, as for training).
#: ZeRO-1/2's 16-bit reduce buckets on a single rank without offload, which runs without overlap_comm
#: (dskit/plan/deepspeed.py), where its gradients do not go flat (fp16)
ONE_RANK_REDUCE_BUCKETS = 1
WEIGHT_BYTES = 2  # bf16 or fp16 weights; construction never holds fp32 copies on the GPU


# zero_optimization.reduce_bucket_size as dskit/plan/deepspeed.py writes it (DeepSpeed's default), elements
REDUCE_BUCKET_ELEMENTS = 5 * 10**8


def gpu_state_bytes(offload: bool) -> float:
    """Bytes per trained parameter of a ZeRO-3 rank's shard on its GPU: the 16 of mixed-precision Adam,
    or with the optimizer offloaded the 16-bit weight alone (2): the gradients are partitioned straight
    into a pinned host buffer (DeepSpeed 0.19.8 stage3.py `grad_partitions_flat_buffer`); the measured
    difference between resident and offloaded runs agrees (docs/planner.md "Optimizer offload, measured")."""
    return 2.0 if offload else 16.0


# Chunked loss (dskit/train/loss.py): rows of the output projection computed at once. 4096 x 102400
# bf16 logits and their gradient are 1.7 GB: GEMMs large enough to run at full rate, memory
# independent of the batch.
LOSS_CHUNK_TOKENS = 4096


def loss_bytes(s: ModelShape, tokens: int, chunk_tokens: int) -> int:
    """Peak bytes of the language-model loss beyond the model's other activations."""
    V, h = s.vocab, s.hidden
    if not chunk_tokens:
        return tokens * V * (2 + 4 + 4)  # bf16 logits, their fp32 upcast, the fp32 gradient
    rows = min(tokens, chunk_tokens)
    # one chunk: bf16 logits and their bf16 gradient (the softmax between them is fused on GPUs);
    # the weight's bf16 gradient (accumulated in place by addmm); the hidden states' bf16 gradient
    return rows * V * (2 + 2) + V * h * 2 + tokens * h * 2


def loss_chunk_for(s: ModelShape, tokens: int, choice: str) -> int:
    """`overrides.loss` -> chunk size (0: full logits). auto: chunked where it needs less memory, i.e.
    when a micro-step has more tokens than a chunk plus the weight's gradient (the fixed cost) are worth."""
    if choice == "full":
        return 0
    if choice == "chunked":
        return LOSS_CHUNK_TOKENS
    chunked = loss_bytes(s, tokens, LOSS_CHUNK_TOKENS)
    return LOSS_CHUNK_TOKENS if chunked < loss_bytes(s, tokens, 0) else 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Steady-state training memory per GPU."""

    states_gib: float
    working_set_gib: float
    activations_gib: float
    logits_gib: float
    overhead_gib: float

    @property
    def total_gib(self) -> float:
        return (
            self.states_gib
            + self.working_set_gib
            + self.activations_gib
            + self.logits_gib
            + self.overhead_gib
        )

    def as_dict(self) -> dict[str, Any]:
        d = {k: round(v, 2) for k, v in asdict(self).items()}
        d["total_gib"] = round(self.total_gib, 2)
        return d


@dataclass(frozen=True)
class ConstructionEstimate:
    """Peak memory per GPU while the model is built partitioned, before the optimizer exists."""

    shard_gib: float  # this rank's 1/world of the 16-bit weights
    gathered_gib: float  # the largest module, gathered whole while it is initialised
    autoep_copy_gib: float  # AutoEP's copy of one MoE layer's local experts
    overhead_gib: float

    @property
    def total_gib(self) -> float:
        return self.shard_gib + self.gathered_gib + self.autoep_copy_gib + self.overhead_gib


def local_params(c: ModelCounts, ep_size: int) -> float:
    """Parameters whose 16-bit weights a ZeRO-1/2 rank holds: all non-expert ones, 1/ep of the experts."""
    experts = c.experts_per_layer * c.moe_layers
    return c.total - experts + experts / ep_size


def construction(
    c: ModelCounts,
    *,
    world: int,
    ep_size: int,
    on_gpu: bool,
    zero_stage: int = 3,
    tuning: Tuning | None = None,
) -> ConstructionEstimate:
    """ZeRO-1/2 build the whole 16-bit model on each GPU (dskit/train/model.py), then AutoEP copies one
    layer's local experts out of it at a time: the whole model is the "shard". A LoRA run (`tuning`)
    builds the base in its precision and the adapters in bf16. An FP8 base (ZeRO-1/2 only) is built
    from the meta device (dskit/train/fp8/construct.py): each rank only ever holds its own share, the
    non-expert base and 1/ep of the experts in FP8, and AutoEP's copy of a layer's experts is a meta
    tensor that the checkpoint's FP8 bytes replace."""
    if tuning is not None:
        t = tuning
        if t.fp8:
            return ConstructionEstimate(
                shard_gib=(t.frozen_weight_bytes(ep_size) + BF16_BYTES * t.trainable_local(ep_size)) / GIB,
                gathered_gib=0.0,
                autoep_copy_gib=0.0,
                overhead_gib=OVERHEAD_GIB if on_gpu else 0.0,
            )
        other = c.largest_module if c.largest_module > c.experts_per_layer else 0
        gathered = max(t.expert_bytes * c.experts_per_layer, BF16_BYTES * other)
        whole = t.expert_bytes * t.frozen_experts + t.other_bytes * t.frozen_other + BF16_BYTES * t.trainable
        return ConstructionEstimate(
            shard_gib=whole / (1 if zero_stage != 3 else world) / GIB,
            # the largest module: one MoE layer's experts (in the base's precision), or a bf16 one larger
            gathered_gib=0.0 if zero_stage != 3 else gathered / GIB,
            autoep_copy_gib=t.expert_bytes * c.experts_per_layer / ep_size / GIB,
            overhead_gib=OVERHEAD_GIB if on_gpu else 0.0,
        )
    if zero_stage != 3:
        return ConstructionEstimate(
            shard_gib=WEIGHT_BYTES * c.total / GIB,
            gathered_gib=0.0,
            autoep_copy_gib=WEIGHT_BYTES * c.experts_per_layer / ep_size / GIB,
            overhead_gib=OVERHEAD_GIB if on_gpu else 0.0,
        )
    return ConstructionEstimate(
        shard_gib=WEIGHT_BYTES * c.total / world / GIB,
        gathered_gib=WEIGHT_BYTES * c.largest_module / GIB,
        autoep_copy_gib=WEIGHT_BYTES * c.experts_per_layer / ep_size / GIB,
        overhead_gib=OVERHEAD_GIB if on_gpu else 0.0,
    )


#: AutoEP's top-k combine as its fused Triton kernel (`expert_parallel.combine_impl: fused_weighted_sum`)
#: instead of its eager weighted sum, which multiplies the [tokens, k, hidden] expert rows by their
#: routing weights in fp32 and sums them (two fp32 transients of that size at the backward peak), on GPUs
#: from this many tokens per micro-step. Measured on one H200 (bench/results/peer/
#: h200-vs-torchtitan-combine-2026-12-04.json): at 65,536 tokens 9% faster and 5.4 GiB smaller; at 2,048
#: (-combine-s2048-2026-12-04.json) 8% slower, one sample each. The line between the two samples breaks
#: even near 10k tokens; the switch is set at half the measured win, where no run has measured a loss
FUSED_COMBINE_MIN_TOKENS = 32768
#: off only to predict runs measured before the trainer used it (bench/runs.py `as_measured`)
FUSED_COMBINE = True


def fused_combine(on_gpu: bool, tokens: int, world: int, precision: str) -> bool:
    """Whether AutoEP combines the routed experts' outputs with its fused kernel (a GPU kernel): from
    FUSED_COMBINE_MIN_TOKENS tokens per micro-step, on one rank in bf16, where it was measured (fp16 GPUs
    are older than the Triton kernels AutoEP ships were written for). Several ranks keep
    the eager combine until a run there measures it: under EP the kernel restores rows an all-to-all
    brought back, a path no lent machine has run, and its memory saving alone would move multi-node picks (to
    EP 1 and longer micro-steps) on the strength of one GPU."""
    return (
        FUSED_COMBINE and on_gpu and precision == "bf16" and world == 1 and tokens >= FUSED_COMBINE_MIN_TOKENS
    )


#: the share of combine_transient_bytes' count the measured peak lost (5.4 GiB at 65,536 tokens of V2-Lite,
#: one H200): the plan takes off no more than was measured
COMBINE_TRANSIENT_MEASURED_SHARE = 0.9


def combine_transient_bytes(s: ModelShape, tokens: int) -> float:
    """The eager combine's fp32 transients the fused kernel does not allocate, as measured: by count the
    weighted [tokens, k, hidden] product and its gradient, both alive at the backward peak of a MoE
    layer, times COMBINE_TRANSIENT_MEASURED_SHARE."""
    return COMBINE_TRANSIENT_MEASURED_SHARE * 2 * 4 * tokens * s.active_experts * s.hidden


#: whether the trainer takes one_rank_fused() plans' gradients flat (dskit/train/flat_grads.py): off only to
#: predict runs measured before it did (bench/runs.py `as_measured`)
FLAT_GRADIENTS = True


def one_rank_fused(world: int, zero_stage: int, offload: bool, fused_step: bool, precision: str) -> bool:
    """ZeRO-1/2's fused step on one rank in bf16, without offload: a step that reads nothing back to the
    host (fp16 keeps DeepSpeed's overflow check)."""
    return world == 1 and zero_stage in (1, 2) and not offload and fused_step and precision == "bf16"


def flat_gradients(world: int, zero_stage: int, offload: bool, fused_step: bool, precision: str) -> bool:
    """Whether ZeRO-1/2's gradients accumulate straight into one flat buffer per parameter group
    (dskit/train/flat_grads.py): on one_rank_fused() plans, where nothing reads DeepSpeed's gradient
    structures. Then there are no reduce buckets, no second gradient copy at the accumulation boundary,
    and no per-gradient hook on the host."""
    return FLAT_GRADIENTS and one_rank_fused(world, zero_stage, offload, fused_step, precision)


def boundary_grad_copy(trained: float, world: int, zero_stage: int, grad_accum: int) -> float:
    """Bytes of the second 16-bit gradient partition ZeRO-1/2 hold in a backward after the first of an
    optimizer step: DeepSpeed 0.19.8 (stage_1_and_2.py `copy_grads_in_partition`) allocates a contiguous
    buffer for the rank's partition of the reduced gradients at the first gradient reduced, so most
    activations are alive, while the gradients accumulated so far are too: ZeRO-1's in the parameters'
    own `.grad` (reduced only at the boundary), ZeRO-2's in the previous micro-step's buffer, which
    `all_grad_tensors` still holds after `_release_ipg_buffers` dropped it. Without accumulation the
    parameters' gradients are made one at a time and moved into the buffer as they come: no second copy.
    A memory snapshot at V3's width with accumulation shows both copies live at the peak, for ZeRO-1 and
    ZeRO-2 alike (docs/planner.md "The second gradient copy at the accumulation boundary"). On several GPUs this is
    a floor: the buffer holds every parameter that reaches into the partition whole, so one straddling a
    partition's edge counts in full. `trained`: the parameters with gradients (all, or a LoRA run's
    trainable ones)."""
    if zero_stage == 3 or grad_accum <= 1:
        return 0.0
    return BF16_BYTES * trained / world


def lora_states(
    c: ModelCounts, t: Tuning, world: int, ep_size: int, offload: bool, zero_stage: int
) -> tuple[float, float]:
    """(model-state bytes, working-set bytes) per GPU of a LoRA run: frozen weights keep only their
    weights (no gradient, no optimizer state: DeepSpeed leaves requires_grad=False parameters out of
    the optimizer, stage3.py and stage_1_and_2.py), the trainable ones the 16 bytes of mixed-precision
    Adam. ZeRO-3 shards both over the ranks (experts over the expert-data-parallel group: P/world either
    way); ZeRO-1/2 keep the frozen weights a rank uses whole and shard the trainable states."""
    T = t.trainable
    if zero_stage == 3:
        frozen = (t.expert_bytes * t.frozen_experts + t.other_bytes * t.frozen_other) / world
        states = frozen + gpu_state_bytes(offload) * T / world
        layer_bytes = t.other_bytes * c.largest_layer
        if world // ep_size > 1:  # local experts gathered with their layer, as in full training
            layer_bytes = max(
                layer_bytes,
                t.other_bytes * c.moe_layer_non_expert + t.expert_bytes * c.experts_per_layer / ep_size,
            )
        # two gathered layers; gradient buckets of the trainable parameters only
        working = 2 * layer_bytes + 2 * BF16_BYTES * t.largest_layer_trainable
    else:
        local = t.trainable_local(ep_size)  # the routed adapters, like the experts, 1/ep per rank
        grads = BF16_BYTES * (local if zero_stage == 1 else T / world)
        states = t.frozen_weight_bytes(ep_size) + BF16_BYTES * local + grads + 12 * T / world
        working = 2 * BF16_BYTES * min(REDUCE_BUCKET_ELEMENTS, local)
    # fp8: the largest linear dequantised for its GEMM, and one MoE layer's local experts dequantised by
    # their parametrization (the forward's; the backward dequantises again); routed adapters' delta: the
    # gradient of one layer's W_eff while that layer's backward runs
    return states, working + t.dequant_bytes + (t.expert_dequant_bytes + t.routed_delta_bytes) / ep_size


def _activation_bytes_per_token_layer(s: ModelShape, dense: bool) -> int:
    h, nh = s.hidden, s.heads
    dqk, dv = s.head_dims
    kvl, ql = s.kv_lora_rank, s.q_lora_rank
    # residual + 2 norms + attention input/output projections, q/k/v, attention output, lora latents
    attn = 6 * h + 3 * nh * dqk + 2 * nh * dv + kvl + ql
    if dense:
        mlp = 2 * h + 3 * s.dense_intermediate
    else:
        active = s.active_experts + s.shared_experts
        # each routed copy of the token (k of them) is dispatched, expanded to 3*mi, and combined
        mlp = 2 * h + active * 3 * s.expert_intermediate + s.active_experts * h
    return 2 * (attn + mlp)  # bf16


def compiled_saving_per_token_layer(s: ModelShape, dense: bool) -> int:
    """Activation bytes per token that a layer does not keep when its RMSNorms and SwiGLU are compiled:
    the fp32 copy of every norm's input (eager `hidden_states.to(float32)` saved by pow and mul) and the
    SiLU output of the shared experts' (or the dense layer's) SwiGLU, saved by the eager product.
    Routed experts are AutoEP's own grouped GEMMs, not compiled. The count agrees with the peak allocated
    eager minus compiled on the GPU (docs/planner.md "The step-time model")."""
    norm_widths = 2 * s.hidden + s.kv_lora_rank + s.q_lora_rank
    if dense:
        silu = s.dense_intermediate
    else:
        silu = s.shared_experts * s.expert_intermediate
    return 4 * norm_widths + 2 * silu


def estimate(w: Workload, cand: Candidate, cluster: Cluster) -> MemoryEstimate:
    """Steady-state training memory per GPU of `cand`. A LoRA run (`w.tuning`, `dskit/plan/adapters.py`)
    holds its frozen base and trains its adapters; ZeRO-1/2 with accumulation hold a second gradient copy
    (`boundary_grad_copy`) unless the gradients go flat (`flat_gradients`: no buckets, no copy)."""
    s, c, tuning = w.shape, w.counts, w.tuning
    world, ep_size, zero_stage, offload = cluster.world, cand.ep_size, cand.zero_stage, cand.offload
    flat = flat_gradients(world, zero_stage, offload, w.fused_step, w.precision)
    if tuning is not None:
        states, working = lora_states(c, tuning, world, ep_size, offload, zero_stage)
    elif zero_stage == 3:
        states = gpu_state_bytes(offload) * c.total / world
        layer = gathered_layer_params(c, world, ep_size)
        working = 2 * 2 * layer + 2 * 2 * layer  # two gathered layers + grad buckets
    else:
        local = local_params(c, ep_size)
        # each parameter's data-parallel group holds world/ep (experts) or world (the rest) copies of it,
        # so the sharded share per rank is total/world either way
        grads = 2 * (local if zero_stage == 1 else c.total / world)
        states = 2 * local + grads + 12 * c.total / world
        # 16-bit reduce buckets: two in flight with overlap_comm (DeepSpeed's double buffer), one rank has one
        buckets = 2 if world > 1 or offload else ONE_RANK_REDUCE_BUCKETS
        working = 0 if flat else 2 * buckets * min(REDUCE_BUCKET_ELEMENTS, local)
    trained = c.total if tuning is None else tuning.trainable
    if not flat:
        working += boundary_grad_copy(trained, world, zero_stage, w.grad_accum(cand))
    tokens = w.tokens(cand)
    L, dense_layers = s.layers, c.dense_layers
    # ACTIVATION_SLACK scales what the eager layers keep (fitted on eager runs); the compiled saving is
    # bytes that are no longer allocated at all
    # two kinds of layer, dense and MoE: each kind's bytes once (the search calls this per candidate)
    dense_a, moe_a = (
        ACTIVATION_SLACK * _activation_bytes_per_token_layer(s, dense=dense)
        - (compiled_saving_per_token_layer(s, dense=dense) if w.compiled else 0)
        for dense in (True, False)
    )
    per_layer = [dense_a if i < dense_layers else moe_a for i in range(L)]
    unkept = [0.0] * L
    if tuning is not None:  # what the adapters keep, scaled like the eager layers' own activations
        per_layer = [
            a + ACTIVATION_SLACK * x for a, x in zip(per_layer, tuning.activation_bytes, strict=True)
        ]
        unkept = [ACTIVATION_SLACK * x for x in tuning.frozen_unkept]
    # The trainer checkpoints layers 0, N, 2N, ... (model.py): those keep only their bf16 input (plus the
    # final hidden state) and are recomputed one at a time in backward, when the layers after them have
    # freed theirs; every other layer keeps all its activations until its own backward. The peak is the
    # larger of the end of forward (all stored layers) and a recompute on top of the stored layers before it.
    ckpt_every = cand.ckpt_every
    ckpt = [bool(ckpt_every) and i % ckpt_every == 0 for i in range(L)]
    kept = ACTIVATION_SLACK * (sum(ckpt) + 1) * 2 * s.hidden if any(ckpt) else 0
    # a MoE layer whose routed experts carry a LoRA delta also keeps its local experts' bf16 W_eff for
    # backward (the expert GEMMs save their weight operand), whatever the token count
    held = tuning.routed_delta_bytes / ep_size if tuning is not None else 0.0
    stored = peak = 0.0
    for i, (a, recomputed, frozen) in enumerate(zip(per_layer, ckpt, unkept, strict=True)):
        a = a * tokens + held * (i >= dense_layers)
        if recomputed:
            peak = max(peak, stored + a)
        else:
            stored += a - frozen * tokens
    act = kept * tokens + max(peak, stored)
    # ACTIVATION_SLACK was fitted with the eager combine's transients allocated
    if c.moe_layers and fused_combine(cluster.on_gpu, tokens, world, w.precision):
        act = max(0.0, act - combine_transient_bytes(s, tokens))
    logits = loss_bytes(s, tokens, loss_chunk_for(s, tokens, w.loss))
    return MemoryEstimate(
        states_gib=states / GIB,
        working_set_gib=working / GIB,
        activations_gib=act / GIB,
        logits_gib=logits / GIB,
        overhead_gib=OVERHEAD_GIB if cluster.on_gpu else 0.0,
    )
