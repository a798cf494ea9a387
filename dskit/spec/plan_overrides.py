"""The spec's `overrides` section: whatever the planner decides, pinned by the user (dskit/plan/parallel.py
applies the pins; docs/plan.md lists them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dskit.spec.values import _Section

# Room for what an estimate cannot see (dskit/plan/fit.py): allocator fragmentation spikes, NCCL buffers
# growing with the communicators, the caching allocator's rounding. The steady-state model lands from 3%
# below to 10% above the peak reserved on the H200 runs (tests/plan/test_plan_calibration.py), on the safe
# side mostly. `overrides.gpu_memory_margin` replaces it for a run that takes the risk, down to
# GPU_MEMORY_MIN_MARGIN: the 3% the estimate has measured below a peak.
GPU_MEMORY_MARGIN = 0.10
GPU_MEMORY_MIN_MARGIN = 0.03


class PlanOverrides(_Section):
    """Anything the planner decides can be pinned here; `auto`/null lets the planner choose: the
    fastest candidate that fits (`dskit plan --explain` shows them all)."""

    ep_size: int | None = Field(
        None,
        ge=1,
        description="Expert-parallel group size (AutoEP autoep_size). Default: the predicted fastest.",
    )
    zero_stage: int | None = Field(
        None,
        ge=1,
        le=3,
        description="DeepSpeed ZeRO stage. 3: weights, gradients and optimizer states sharded (gathered per "
        "layer); 2: gradients and optimizer states sharded, 16-bit weights whole on every GPU (the model is "
        "built whole on each GPU first); 1: optimizer states sharded. Default: the predicted fastest "
        "that fits (ZeRO-3 on the cpu profile).",
    )
    micro_batch: int | None = Field(
        None,
        ge=1,
        description="Sequences per GPU per forward; the rest of the per-GPU batch is gradient accumulation.",
    )
    activation_checkpointing: int | None = Field(
        None,
        ge=0,
        description="0: off; 1: every layer; N: layers 0, N, 2N, ... (the others keep their activations). "
        "Default: the predicted fastest that fits of off, every 2nd layer and every layer.",
    )
    gpu_memory_margin: float | None = Field(
        None,
        ge=GPU_MEMORY_MIN_MARGIN,
        le=0.5,
        description="Share of each GPU's usable memory a plan leaves free beyond its estimate (allocator "
        f"fragmentation, NCCL buffers). Default: {GPU_MEMORY_MARGIN:.2f}; at least {GPU_MEMORY_MIN_MARGIN:.2f}, the "
        "most the estimate has measured below a peak. The estimate is mostly a little high, so a smaller margin "
        "can take a much faster plan that misses the default limit by a little (the plan warns when one does), "
        "at the risk of running out of GPU memory.",
    )
    precision: Literal["auto", "bf16", "fp16"] = Field(
        "auto", description="bf16 where the GPU has it, else fp16 with dynamic loss scaling."
    )
    attention: Literal["auto", "sdpa", "sdpa_cudnn", "flash_attention_2", "flash_attention_4", "eager"] = (
        Field("auto", description="Attention backend. auto: the GPU profile's measured-fastest.")
    )
    offload_optimizer: Literal["auto", "none", "cpu"] = Field(
        "auto",
        description="ZeRO optimizer-state offload. auto: whichever the predicted fastest candidate that fits uses.",
    )
    compile: Literal["auto", "off", "regions", "on"] = Field(
        "auto",
        description="torch.compile. regions: the decoder's RMSNorm, SwiGLU and rotary code (measured on H200: "
        "8% faster and 7.6 GiB less where the step is GPU-bound); on: those and, under ZeRO-1/2, each whole "
        "attention block (3.7-7.5% more at micro-batch 2, 3% at 16). auto: on for GPUs; off on the cpu profile, "
        "where inductor's C++ compile costs more than a test run saves.",
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="CUDA graphs over each compiled attention block (torch.compile's reduce-overhead mode; "
        "the attention kernel between its two graphs stays eager), where the host sets the step's pace. Needs "
        "a GPU, compiled attention (overrides.compile on or auto, ZeRO-1/2), rows of one shape (data.packing: "
        "pack) and no activation checkpointing: on narrows the search to those. AutoEP's expert exchange is "
        "data-dependent and stays outside. auto: off (measured on one H100: 0.86-0.98x at micro-batch 1-2; "
        "docs/plan.md).",
    )
    optimizer_step: Literal["auto", "deepspeed", "fused"] = Field(
        "auto",
        description="ZeRO-1/2's optimizer step. fused: torch's fused AdamW, with the gradient clip applied "
        "inside its kernel and the gradient norm taken in fp32 without copies (measured on one H200 at "
        "micro-batch 2: 6-11% more tokens/s in two calls); deepspeed: DeepSpeed's FusedAdam step, as before. auto: fused "
        "wherever it applies (ZeRO-1/2 without optimizer offload; ZeRO-3 and offload keep DeepSpeed's).",
    )
    fp8_experts: Literal["auto", "on", "off"] = Field(
        "auto",
        description="With training.fp8: the routed experts' grouped GEMMs in FP8 (torchao's rowwise scaled "
        "grouped GEMM). auto: where measured faster than bf16, which on Hopper with torchao 0.18 is nowhere "
        "yet (0.65x at DeepSeek-V2-Lite's widths, 0.88x at V3's, on an H100: bench/results/training/h100-fp8-gemm-v3-2026-12-05.json).",
    )
    loss: Literal["auto", "chunked", "full"] = Field(
        "auto",
        description="Language-model loss. chunked: output projection + cross-entropy a few thousand tokens "
        "at a time, never the batch x seq x vocab logits; full: the plain logits path. auto: chunked where it "
        "needs less memory (micro-steps of more than one 4096-token chunk, roughly).",
    )
