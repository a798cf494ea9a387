"""How a run balances its experts' load: the balance loss's coefficient, and whether DeepSeek-V3's
routing bias is updated after each step (auxiliary-loss-free balancing, arXiv:2412.19437 Sec. 2.1.2).

DeepSeek-V3 adds a per-expert bias (`e_score_correction_bias`, "noaux_tc" routing) to the affinities
for top-k selection only; during pre-training it moved the bias by gamma = 0.001 after each step
(decreased for overloaded experts, increased for underloaded ones, Sec. 4.2: 0.001 for the first
14.3T tokens, 0 for the last 500B) with a sequence-wise balance loss of alpha = 1e-4 beside it.
The trainer applies the update (dskit/train/balance.py `BiasUpdate`); this module decides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dskit.errors import SpecError
from dskit.spec import Spec

#: gamma for most of DeepSeek-V3's pre-training (arXiv:2412.19437 Sec. 4.2)
PAPER_BIAS_UPDATE_SPEED = 1e-3
#: the sequence-wise balance loss's alpha beside the bias update (Sec. 4.2)
PAPER_SEQ_AUX_ALPHA = 1e-4

#: model types whose transformers class routes with e_score_correction_bias (noaux_tc)
ROUTING_BIAS_MODEL_TYPES = ("deepseek_v3",)


@dataclass(frozen=True)
class Balance:
    mode: str  # aux_loss, aux_free or frozen
    bias_update_speed: float  # gamma; 0 unless aux_free
    aux_loss_coeff: float


def has_routing_bias(config: dict) -> bool:
    return config.get("model_type") in ROUTING_BIAS_MODEL_TYPES


def plan_balance(spec: Spec, name: str, config: dict, catalog_alpha: float) -> Balance:
    """The run's balancing. auto: aux_free where the model has the bias and the run can carry it (a LoRA
    run's checkpoints and adapter exports hold trained tensors only, so not there), else the bias frozen;
    a model without the bias balances with the loss alone. An explicit choice the model or run cannot
    honour is refused in one line."""
    t = spec.training
    lora = spec.finetune.method == "lora"
    if not has_routing_bias(config):
        if t.balance == "aux_free":
            raise SpecError(
                "training.balance",
                f"{name} ({config.get('model_type')}) has no routing bias (e_score_correction_bias, "
                "DeepSeek-V3's noaux_tc routing) to update: it balances with the loss alone; use auto",
            )
        mode = "aux_loss"
    elif t.balance == "aux_free" and lora:
        raise SpecError(
            "training.balance",
            "aux_free with finetune.method lora: a LoRA run's checkpoints and adapter exports do not carry "
            "the routing bias; use frozen, or a full fine-tune",
        )
    elif t.balance == "auto":
        mode = "frozen" if lora else "aux_free"
    else:
        mode = t.balance
    if t.bias_update_speed is not None and mode != "aux_free":
        raise SpecError(
            "training.bias_update_speed", f"only applies with training.balance aux_free; this run is {mode}"
        )
    if mode == "aux_free":
        gamma = t.bias_update_speed if t.bias_update_speed is not None else PAPER_BIAS_UPDATE_SPEED
        alpha = t.aux_loss_coeff if t.aux_loss_coeff is not None else PAPER_SEQ_AUX_ALPHA
        return Balance(mode, gamma, alpha)
    alpha = t.aux_loss_coeff if t.aux_loss_coeff is not None else catalog_alpha
    return Balance(mode, 0.0, alpha)
