"""Refusals raised on both sides of run.yaml: by the plan, which decides, and by the trainer, which
re-checks what it is handed (a run.yaml edited by hand, a checkpoint moved since). Each is written once,
here, so the two sides cannot drift apart; neither side imports the other for it."""

from __future__ import annotations

from dskit.errors import SpecError


def fp8_base_zero_stage(stage: int) -> SpecError:
    """An fp8 frozen base under a ZeRO stage that cannot hold it (the plan's override check, the
    trainer's start check and its model build)."""
    return SpecError(
        "overrides.zero_stage",
        f"{stage} cannot hold an fp8 frozen base (ZeRO-3 would keep its FP8 layers whole on every "
        "rank, unpartitioned); one of: auto, 1, 2 (or finetune.base_precision bf16)",
    )


def no_fp8_checkpoint(path: str | None) -> SpecError:
    """An fp8 base without DeepSeek-V3's FP8 checkpoint at model.path (plan and trainer)."""
    where = (
        f"{path} holds none"
        if path
        else "the run has no weights to read (model.path unset, or a config.json alone)"
    )
    return SpecError(
        "finetune.base_precision",
        f"fp8 keeps model.path's FP8 weights as the frozen base, and {where} (DeepSeek-V3's format: e4m3 "
        "weights with 128 x 128 weight_scale_inv); one of: auto, bf16 (or set model.path to the FP8 checkpoint)",
    )


#: compute capability FP8 training needs: the routed experts' FP8 grouped GEMM (torch._scaled_grouped_mm)
#: runs on sm_90 and newer only
FP8_MIN_CAPABILITY = (9, 0)


def fp8_compute_unsupported(gpu: str, why: str) -> SpecError:
    """`training.fp8` on a GPU that cannot run it: the plan on the catalog's word, the trainer on the
    device it finds (a run.yaml moved to other hardware)."""
    return SpecError("training.fp8", f"{gpu} {why}; one of: off (FP8 needs Hopper or newer: h100, h200)")


def fp8_with_lora() -> SpecError:
    """training.fp8 on a LoRA run (plan and trainer): torchao's FP8 linear computes every weight's gradient,
    a frozen base's too, so its product costs 6 FLOPs a weight where bf16's frozen base costs 4, and an FP8
    frozen base (finetune.base_precision fp8) has its own FP8 linears that training.fp8 does not convert."""
    return SpecError(
        "training.fp8",
        "applies to full fine-tuning and pre-training; a LoRA run's frozen base would pay FP8 weight "
        "gradients it never uses (finetune.base_precision fp8 keeps the base in FP8 already); one of: off",
    )
