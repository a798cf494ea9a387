"""The spec's `finetune` section: full fine-tuning (today's default) or LoRA adapters on a frozen base.

Names follow peft's `LoraConfig` (r, lora_alpha as `alpha`, lora_dropout as `dropout`), so a user who
knows peft knows these. Which modules each `targets` name covers is decided in dskit/plan/adapters.py
(the regexes the trainer hands to peft); here only the names are checked.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from dskit.errors import one_of
from dskit.spec.values import _Section

#: what `finetune.lora.targets` may name, in the order the docs list them
LORA_TARGETS = ("attention", "shared_experts", "dense_mlp", "router", "routed_experts")
#: attention projections + shared experts: every token passes through both (unlike a routed expert,
#: which sees top-k / E of them), they are a small share of the bytes (V2-Lite: 16 M adapter parameters
#: at r 16 against 15.7 B frozen), and they are plain nn.Linear layers that peft wraps in place
#: (docs/planner.md "LoRA").
DEFAULT_LORA_TARGETS = ("attention", "shared_experts")


class LoraSpec(_Section):
    r: int = Field(16, ge=1, le=4096, description="LoRA rank (peft `r`).")
    alpha: float = Field(
        32.0,
        gt=0,
        le=1e6,
        description="LoRA scaling numerator (peft `lora_alpha`): updates scale by alpha / r.",
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapters' input (peft `lora_dropout`); 0 keeps no copy."
    )
    targets: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        description="What gets adapters: attention (q/kv/o projections), shared_experts, dense_mlp (the first "
        "dense layers' MLP), router (trained fully: it is E x hidden per layer, not a linear to adapt), "
        "routed_experts (an adapter per expert on gate, up and down, applied as a weight delta under AutoEP; "
        "needs dropout 0). Default: attention and shared_experts, which every token uses.",
    )

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError(f"must name at least one target; {one_of(LORA_TARGETS)}")
        for t in v:
            if t not in LORA_TARGETS:
                raise ValueError(f"{t!r} is not a target; {one_of(LORA_TARGETS)}")
        if len(set(v)) != len(v):
            raise ValueError("names a target twice")
        return v

    @model_validator(mode="after")
    def _no_dropout_on_routed(self) -> LoraSpec:
        # peft's dropout acts on an adapter's input; routed experts are adapted through their weight
        # (dskit/train/lora/routed.py), which sees no input (peft's ParamWrapper refuses it too)
        if self.dropout and "routed_experts" in self.targets:
            raise ValueError(
                f"dropout {self.dropout:g} cannot apply to routed_experts (adapted as a weight delta, which "
                "sees no input): set finetune.lora.dropout=0 or drop routed_experts from targets"
            )
        return self


class FinetuneSpec(_Section):
    method: Literal["full", "lora"] = Field(
        "full",
        description="full: every weight trains (BF16 weights, fp32 Adam states); lora: the base is frozen and "
        "only finetune.lora's adapters (and the router, if targeted) train and are checkpointed.",
    )
    base_precision: Literal["auto", "bf16", "fp8"] = Field(
        "auto",
        description="How the frozen base is held on the device (method lora): bf16, or fp8 as DeepSeek-V3 ships "
        "it (e4m3 + fp32 scales per 128 x 128 block: 1 byte per weight), read from model.path's FP8 checkpoint. "
        "auto: fp8 when model.path holds DeepSeek-V3's FP8 format and method is lora (bf16, with a warning, where "
        "no fp8 plan fits), else bf16. A catalog "
        "preset may set fp8 to plan it; training it needs the FP8 checkpoint at model.path.",
    )
    lora: LoraSpec = Field(default_factory=LoraSpec)

    @model_validator(mode="after")
    def _fp8_needs_lora(self) -> FinetuneSpec:
        if self.base_precision == "fp8" and self.method != "lora":
            raise ValueError(
                "base_precision fp8 keeps a frozen base: it needs finetune.method lora (full fine-tuning "
                "trains every weight in bf16)"
            )
        return self
