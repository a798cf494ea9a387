"""How a run balances its experts' load: the balance loss's coefficient, and whether DeepSeek-V3's
routing bias is updated after each step (auxiliary-loss-free balancing, arXiv:2412.19437 Sec. 2.1.2).

DeepSeek-V3 adds a per-expert bias (`e_score_correction_bias`, "noaux_tc" routing) to the affinities
for top-k selection only; during pre-training it moved the bias by gamma = 0.001 after each step
(decreased for overloaded experts, increased for underloaded ones, Sec. 4.2: 0.001 for the first
14.3T tokens, 0 for the last 500B) with a sequence-wise balance loss of alpha = 1e-4 beside it.
The trainer applies the update (dskit/train/balance.py `RouterTap.after_step`); this module decides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dskit.errors import SpecError
from dskit.plan.schema import Plan
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
    """The run's balancing. auto: aux_free where the model has the bias, except in a LoRA run, which
    keeps it frozen: such a run promises the base untouched and a small adapter, and an updated bias
    changes the base's routing and ships every router whole in the adapter (peft's modules_to_save);
    `aux_free` asks for that explicitly. A model without the bias balances with the loss alone. An
    explicit choice the model cannot honour is refused in one line."""
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


def describe(plan: Plan) -> str:
    """One line for `dskit plan --explain` and `dskit report`: which balancing the plan chose and why."""
    m, lora = plan.model, plan.finetune is not None
    model_name, balance, gamma, alpha = m.name, m.balance, m.bias_update_speed, m.aux_loss_coeff
    if balance == "aux_free":
        return (
            f"balance aux_free: {model_name} routes with a per-expert bias (DeepSeek-V3's noaux_tc); after each "
            f"step it moves by gamma {gamma:g} against each expert's load, summed over every rank "
            f"(auxiliary-loss-free balancing, arXiv:2412.19437 Sec. 2.1.2), beside a balance loss "
            f"of alpha {alpha:g}" + ("; the adapter export carries every router whole" if lora else "")
        )
    if balance == "frozen":
        why = "training.balance auto keeps it in a LoRA run" if lora else "training.balance frozen"
        return (
            f"balance frozen: {model_name}'s routing bias stays as loaded ({why}; aux_free updates it); "
            f"the balance loss, alpha {alpha:g}, balances alone"
        )
    return f"balance aux_loss: {model_name} has no routing bias; the balance loss, alpha {alpha:g}, balances"
