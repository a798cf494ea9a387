"""MoE load balance: the auxiliary balance loss and per-expert token load, from router hooks.

DeepSeek-V2 (arXiv:2405.04434, Sec. 2.2.3) expert-level balance loss, per MoE layer:
    L = alpha * sum_i f_i * P_i,   f_i = N / (K * T) * #tokens routed to expert i,   P_i = mean_t s_{i,t}
with N routed experts, K experts per token, T tokens. With seq_aux (the configs' default) T is one
sequence and the loss is averaged over the batch. DeepSeek-V3 (arXiv:2412.19437, Eq. 17-20) uses the
same form on sigmoid scores normalised over experts. Layers' losses are summed, as DeepSeek's reference
code adds one per gate.

Auxiliary-loss-free balancing (DeepSeek-V3, arXiv:2412.19437 Sec. 2.1.2): the router adds a per-expert
bias (`e_score_correction_bias`, which AutoEP copies into its router as an fp32 buffer) to the affinities
for top-k selection only. With the plan's `bias_update_speed` gamma > 0, `after_step` moves it after each
optimizer step by gamma * sign(mean load - load), from that step's token counts summed over every rank
(one all-reduce of the [layers, experts] counts). The counts are integers and the sign is taken on them
exactly (total - experts * load), so every rank adds the same fp32 values and the bias stays
bit-identical across ranks (checked at every log step: `expert_bias_rank_max_diff`, and at every
checkpoint save and load). A buffer is no parameter: the optimizer never touches it, and neither
DeepSpeed's universal checkpoint nor a LoRA run's files carry it, so every checkpoint holds it in a file
of dskit's own (dskit/train/checkpoints/routing_bias.py).

The hooks sit on AutoEP's router (`TokenChoiceTopKRouter`: its `gate` Linear gives the logits, its
output the chosen experts and per-expert counts). They collect only while `collecting` is set, so the
recomputation of checkpointed layers during backward adds nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dskit.train.checkpoints.routing_bias import rank_max_diff_tensor

BIAS = "e_score_correction_bias"


class RouterTap:
    def __init__(self, model: nn.Module, *, score_func: str, top_k: int, bias_update_speed: float = 0.0):
        self.score_func, self.top_k = score_func, top_k
        self.collecting = False
        self.logits: list[torch.Tensor] = []
        self.selected: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []
        self.step_from = 0  # counts[step_from:] belong to the step not yet closed by after_step
        self.layers = 0
        routers, names = [], []
        for name, mod in model.named_modules():
            if type(mod).__name__ == "TokenChoiceTopKRouter":
                mod.gate.register_forward_hook(self._on_gate)
                mod.register_forward_hook(self._on_router)
                routers.append(mod)
                names.append(f"{name}.{BIAS}")
                self.layers += 1
        if self.layers == 0:
            raise RuntimeError(
                "no AutoEP router found: was the model wrapped by deepspeed.initialize with expert_parallel?"
            )
        self.speed = bias_update_speed
        self.biases = routing_biases(routers, updated=bias_update_speed > 0)
        #: module name -> the router's bias tensor itself (not a copy), which checkpoints save and
        #: restore (dskit/train/checkpoints/routing_bias.py); empty without a routing bias
        self.named_biases = dict(zip(names, self.biases, strict=False)) if self.biases else {}

    def _on_gate(self, _mod, _inp, out: torch.Tensor) -> None:
        if self.collecting:
            self.logits.append(out)

    def _on_router(self, _mod, _inp, out) -> None:
        if self.collecting:
            _scores, selected, counts = out
            self.selected.append(selected)
            self.counts.append(counts.detach())

    def start(self) -> None:
        self.logits.clear()
        self.selected.clear()
        self.collecting = True

    def stop(self) -> None:
        self.collecting = False

    def aux_loss(self, batch: int, alpha: float, seq_aux: bool) -> torch.Tensor:
        """Sum over layers of the balance loss for the forward just run (tokens ordered [batch, seq]).
        Every forward fills one entry per router (the constructor found at least one)."""
        layers = []
        for logits, selected in zip(self.logits, self.selected, strict=True):
            n_exp = logits.shape[-1]
            if self.score_func == "sigmoid":
                s = torch.sigmoid(logits.float())
                s = s / s.sum(-1, keepdim=True)
            else:
                s = torch.softmax(logits.float(), dim=-1)
            groups = batch if seq_aux else 1
            s = s.view(groups, -1, n_exp)  # [G, T, N]
            tokens = s.shape[1]
            hits = torch.zeros(groups, n_exp, device=s.device, dtype=torch.float32)
            hits.scatter_add_(
                1, selected.view(groups, -1), torch.ones_like(selected.view(groups, -1), dtype=torch.float32)
            )
            f = hits * n_exp / (self.top_k * tokens)
            layers.append((f * s.mean(1)).sum(-1).mean())
        self.logits.clear()
        self.selected.clear()
        return alpha * sum(layers[1:], layers[0])  # summed in layer order

    def take_load(self) -> torch.Tensor | None:
        """[layers, experts] token counts accumulated since the last call (this rank only)."""
        if not self.counts:
            return None
        per_forward = len(self.counts) // self.layers
        stacked = torch.stack([c.float() for c in self.counts]).view(per_forward, self.layers, -1).sum(0)
        self.counts.clear()
        self.step_from = 0
        return stacked

    @torch.no_grad()
    def after_step(self, taken: torch.Tensor | float = 1.0) -> None:
        """Collective when the bias is updated: bias += gamma * sign(mean load - load) per MoE layer, from
        the token counts of the step just taken summed over all ranks. Call after engine.step().
        `taken`: 0 where the optimizer skipped the step (a non-finite gradient norm; a tensor on the
        device for the fused step, so no sync): the bias stays with the weights it was routing for."""
        step = self.counts[self.step_from :]
        self.step_from = len(self.counts)
        if not self.speed:
            return
        per_forward = len(step) // self.layers
        load = torch.stack([c.long() for c in step]).view(per_forward, self.layers, -1).sum(0)
        dist.all_reduce(load)  # int64: exact, the same on every rank
        total = load.sum(-1, keepdim=True)
        direction = torch.sign(total - load.shape[-1] * load).float()  # sign(mean - load), exactly
        for bias, d in zip(self.biases, direction, strict=True):
            bias.add_(d.to(bias.device) * (taken * self.speed))

    @torch.no_grad()
    def bias_tensors(self) -> torch.Tensor | None:
        """Collective (at log steps): each layer's bias spread (max - min), then the largest difference
        between any rank's bias and rank 0's, as one tensor on the device, unread (`bias_stats` reads
        it). None without a routing bias."""
        if not self.biases:
            return None
        stacked = torch.stack([b.float() for b in self.biases])
        spread = stacked.max(-1).values - stacked.min(-1).values
        return torch.cat([spread, rank_max_diff_tensor(self.named_biases).to(spread.device)])


def bias_stats(values: torch.Tensor | None) -> dict[str, object]:
    """The record's routing-bias figures from `RouterTap.bias_tensors` on the host (empty without one)."""
    if values is None:
        return {}
    *spread, diff = values.tolist()
    return {
        "expert_bias_spread": max(spread),
        "expert_bias_spread_per_layer": [round(x, 6) for x in spread],
        "expert_bias_rank_max_diff": diff,
    }


def routing_biases(routers: list[nn.Module], *, updated: bool) -> list[torch.Tensor]:
    """Each router's routing bias, in layer order (none: a model without one). One the bias update
    would move must be an fp32 buffer: a parameter would be stepped by the optimizer too (weight decay
    shrinks it), and a bf16 one drops steps of 0.001 at values near 1."""
    biases = [getattr(r, BIAS, None) for r in routers]
    if any(b is None for b in biases):
        if updated:
            raise RuntimeError(f"balance aux_free: AutoEP's routers carry no {BIAS} to update")
        return []
    if updated:
        for r, b in zip(routers, biases, strict=True):
            if BIAS not in r._buffers:
                raise RuntimeError(
                    f"balance aux_free: the router's {BIAS} is a {type(b).__name__}, not a buffer"
                )
            if b.dtype != torch.float32:
                raise RuntimeError(f"balance aux_free: the router's {BIAS} is {b.dtype}, not torch.float32")
    return biases


def load_stats(load: torch.Tensor) -> dict[str, object]:
    """max/mean tokens per expert, per layer and worst layer (1.0 = perfectly balanced), and the raw
    [layer][expert] token counts over the log window, summed over ranks. The counts are whole numbers
    (tokens x top-k routings), so they go in as ints: 64 layers x 256 experts stay ~100 KB a record,
    written only at log steps, and the report draws the heatmap from them."""
    per_layer = (load.max(-1).values / load.mean(-1).clamp_min(1e-9)).tolist()
    return {
        "expert_load_max_over_mean": round(max(per_layer), 3),
        "expert_load_per_layer": [round(x, 3) for x in per_layer],
        "expert_counts": load.round().long().tolist(),
    }
