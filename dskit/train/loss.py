"""The language-model loss without the batch x seq x vocab logits: linear + cross-entropy in chunks.

The plain path materialises bf16 logits, an fp32 copy for the softmax and its fp32 gradient: at
DeepSeek's 102400-token vocabulary that is 10 bytes x tokens x vocab (8.4 GB for 2 x 4096 tokens), the
largest activation of the step (bench/README.md's H200 profiles: the loss kernels alone ~6.5 ms). Here the output
projection runs inside one autograd function, `chunk_tokens` rows at a time: each chunk's logits
exist only while its softmax and both gradients are computed, in the forward pass (the loss is the
graph's last node, so its gradients are known then, as in Liger-Kernel's fused linear cross-entropy);
backward only scales them. On GPUs the per-chunk softmax and gradient are one torch.compile'd pair of
kernels over the bf16 logits (no fp32 copy). Memory: one chunk's bf16 logits and their gradient plus
the weight's gradient in its own dtype, whatever the batch (the planner picks this path only where
that is less than the full logits).

Under ZeRO-3 the function runs inside the output layer's own forward: DeepSpeed gathers the weight
for it and reduce-scatters the gradient it returns, exactly as for a plain linear layer.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from dskit.data import IGNORE_INDEX
from dskit.train.gpu_compiled import on_gpu


def _chunk_loss_and_grad(logits: torch.Tensor, y: torch.Tensor, m: torch.Tensor, scale: torch.Tensor):
    """One chunk: summed loss and d loss / d logits = (softmax - onehot) * scale on kept rows, in the
    logits' dtype. Written as plain tensor ops so torch.compile fuses them into two passes over the
    bf16 logits (a row reduction, then one pointwise kernel); eager mode runs the same ops."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1)
    target = x.gather(1, y.unsqueeze(1)).squeeze(1)
    loss = ((lse - target) * m).sum()
    onehot = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == y.unsqueeze(1)
    g = (torch.exp(x - lse.unsqueeze(1)) - onehot.to(x.dtype)) * (m * scale).unsqueeze(1)
    return loss, g.to(logits.dtype)


# the fused (compiled) chunk on GPUs, eager elsewhere
_chunk_fn = on_gpu(_chunk_loss_and_grad, dynamic=True)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):  # noqa: ANN001 (autograd signature)
        n = hidden.shape[0]
        valid = labels != IGNORE_INDEX
        acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax and sums: fp32 at least
        count = valid.sum().clamp(min=1).to(acc)
        kept, scale = valid.to(acc), 1.0 / count
        y_all = labels.clamp(min=0)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        # in the weight's dtype: addmm_ accumulates each chunk inside the GEMM (fp32 on tensor cores)
        # and rounds once per chunk, with no fp32 copy of a vocabulary-sized matrix
        grad_weight = torch.zeros_like(weight)
        chunk_fn = _chunk_fn(hidden.device)
        for s in range(0, n, chunk):
            h = hidden[s : s + chunk]
            part, g = chunk_fn(h @ weight.t(), y_all[s : s + chunk], kept[s : s + chunk], scale)
            loss += part
            grad_hidden[s : s + chunk] = g @ weight
            grad_weight.addmm_(g.t(), h)
            del g
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss * scale

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        grad_hidden, grad_weight = ctx.saved_tensors
        g = grad_out.to(grad_hidden.dtype)
        return grad_hidden * g, grad_weight * g, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `labels` (IGNORE_INDEX rows excluded), in fp32."""
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk)


@dataclass
class LMOutput(ModelOutput):
    """What the patched model returns: `.loss` with labels, `.logits` without.

    A transformers ModelOutput (a dict), like the CausalLMOutputWithPast the unpatched model returns,
    because ZeRO-3 finds a module's output tensors only in tuples, lists and dicts
    (deepspeed/runtime/zero/utils.py `apply_to_tensors_only`). There it wraps them in the autograd
    function that runs the module's pre-backward hook (gather its parameters, record it in the
    prefetch trace). A plain dataclass hid the loss from that hook: DeepSpeed warned at every start,
    and the root module's hook never ran (harmless only because the root holds no parameters of its
    own). Losses are bit-identical either way, and the speed matched the dataclass's within
    run-to-run spread on CPU.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def _head_forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None):
    """The output layer's forward: logits as before, or with labels the chunked loss (one call, so
    ZeRO-3 gathers the weight once for all chunks)."""
    if labels is None:
        return F.linear(hidden, self.weight, self.bias)
    return linear_cross_entropy(hidden, self.weight, labels, self.dskit_chunk_tokens)


def _model_forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs) -> LMOutput:
    hidden = self.model(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state
    if labels is None:
        return LMOutput(loss=None, logits=self.lm_head(hidden))
    return LMOutput(loss=self.lm_head(hidden, labels), logits=None)


def use_chunked_loss(model, chunk_tokens: int) -> None:
    """Make `model(input_ids, labels=...)` return the chunked loss (and `model(input_ids)` logits).
    Module names and parameters are unchanged, so checkpoints, AutoEP and export see the same model.
    `chunk_tokens` comes from the plan (`parallel.loss_chunk_tokens`), whose memory model counts it."""
    model.lm_head.dskit_chunk_tokens = chunk_tokens
    model.lm_head.forward = types.MethodType(_head_forward, model.lm_head)
    model.forward = types.MethodType(_model_forward, model)
