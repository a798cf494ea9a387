"""The spec's `training` section: sequence length, batch, steps, numerics, the optimizer's schedule, eval,
profiling and expert balancing. The plan turns it into run.yaml's training section (dskit/plan/build.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dskit.spec.values import _Section


class TrainingSpec(_Section):
    seq_len: int = Field(4096, ge=8, description="Tokens per sequence.")
    global_batch: int | None = Field(
        None,
        ge=1,
        description="Sequences per optimizer step, over all ranks. Default: 256 (about 1M tokens at seq 4096), "
        "or 4 per GPU on clusters of more than 64 GPUs (1024 at 256 GPUs), rounded up to a multiple of the "
        "world size (264 at 24 GPUs).",
    )
    steps: int = Field(1000, ge=1, description="Optimizer steps.")
    fp8: Literal["off", "on", "rowwise", "tensorwise"] = Field(
        "off",
        description="FP8 matrix products (torchao) with bf16 weights, gradients and optimizer states. It changes "
        "the numerics, so it is off unless asked. The plan then puts in FP8 the linears measured faster so "
        "(large enough to amortise the casts: e.g. DeepSeek-V3's o_proj and dense MLPs, not MLA's small "
        "projections) and keeps the router, embeddings, output head and routed experts bf16 "
        "(`overrides.fp8_experts`); `dskit plan --explain` lists them and shows bf16 beside FP8. on: the "
        "fastest recipe (tensorwise); rowwise: one scale per row, slower but closer to bf16's loss (measured with "
        "every linear in FP8 over 300 steps: +2.3% against tensorwise's +6.9%, bf16's own repeat 0.45%); "
        "tensorwise: one per tensor. Full fine-tuning and pre-training only (not LoRA); Hopper and newer.",
    )
    lr: float = Field(1.5e-4, gt=0, le=10, description="Peak learning rate (the seed post's tuned 1.5e-4).")
    warmup_ratio: float = Field(
        0.03, ge=0, lt=1, description="Linear warmup as a fraction of steps (seed: 3%)."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor as a fraction of lr.")
    weight_decay: float = Field(0.1, ge=0, le=10, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="Gradient norm clip (0 disables).")
    seed: int = Field(1234, ge=0, le=2**32 - 1, description="Seed for init and data order.")
    log_every: int = Field(10, ge=1, description="Steps between log lines / metrics records.")
    eval_every: int = Field(
        200,
        ge=1,
        description="Steps between eval losses on the held-out set (and one at the end); only when there is "
        "one: data.eval_path, or DATA/eval from `dskit data prepare --eval-fraction`.",
    )
    eval_batches: int = Field(
        8,
        ge=1,
        le=100000,
        description="Micro-batches per rank in one eval (the same held-out samples every time; fewer when "
        "the held-out set is smaller).",
    )
    profile_steps: int = Field(
        0,
        ge=0,
        le=1000,
        description="Profile this many steps on rank 0 after a 5-step warm-up: OUTPUT_DIR/profile.json "
        "(time per step by kernel category) and a Chrome trace. 0: off.",
    )
    aux_loss_coeff: float | None = Field(
        None,
        ge=0,
        le=1e3,
        description="MoE balance loss coefficient. Default: the model config's aux_loss_alpha; with "
        "balance aux_free, the paper's sequence-wise 1e-4.",
    )
    balance: Literal["auto", "aux_free", "frozen"] = Field(
        "auto",
        description="Expert load balancing of models with a routing bias (DeepSeek-V3's e_score_correction_bias, "
        "noaux_tc routing). aux_free: after each step every expert's bias moves by bias_update_speed towards "
        "the mean load (arXiv:2412.19437 Sec. 2.1.2), beside a small balance loss; frozen: the bias stays as "
        "loaded and the balance loss alone balances. auto: aux_free on models with the bias (frozen for LoRA "
        "runs, which may set aux_free: their adapter export then carries every router whole); models without "
        "one balance with the loss alone.",
    )
    bias_update_speed: float | None = Field(
        None,
        gt=0,
        le=1,
        description="The bias update speed gamma of balance aux_free. Default: 0.001, the paper's for most "
        "of pre-training.",
    )
