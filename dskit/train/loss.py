"""The language-model loss without the batch x seq x vocab logits: linear + cross-entropy in chunks.

The plain path materialises bf16 logits, an fp32 copy for the softmax and its fp32 gradient: at
DeepSeek's 102400-token vocabulary that is 10 bytes x tokens x vocab (8.4 GB for 2 x 4096 tokens), the
largest activation of the step (DESIGN.md's profile: the fp32 softmax alone ~6.5 ms). Here the output
projection runs inside one autograd function, `chunk_tokens` rows at a time: each chunk's logits
exist only while its softmax and both gradients are computed, in the forward pass (the loss is the
graph's last node, so its gradients are known then, as in Liger-Kernel's fused linear cross-entropy);
backward only scales them. Memory: one chunk's fp32 logits plus the weight's gradient in its own
dtype, whatever the batch (the planner picks this path only where that is less than the logits).

Under ZeRO-3 the function runs inside the output layer's own forward: DeepSpeed gathers the weight
for it and reduce-scatters the gradient it returns, exactly as for a plain linear layer.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # labels with this value carry no loss (transformers' convention)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):  # noqa: ANN001 (autograd signature)
        n = hidden.shape[0]
        valid = labels != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax and sums: fp32 at least
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        # in the weight's dtype: addmm_ accumulates each chunk inside the GEMM (fp32 on tensor cores)
        # and rounds once per chunk, with no fp32 copy of a vocabulary-sized matrix
        grad_weight = torch.zeros_like(weight)
        for s in range(0, n, chunk):
            h, y, m = hidden[s : s + chunk], labels[s : s + chunk], valid[s : s + chunk]
            logits = (h @ weight.t()).to(acc)
            lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            loss += ((lse - target) * m).sum()
            # d loss / d logits = (softmax - onehot) / count, zero on ignored rows
            probs = torch.exp(logits.sub_(lse.unsqueeze(1)))
            probs.scatter_add_(1, y.clamp(min=0).unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
            probs.mul_((m.to(acc) / count).unsqueeze(1))
            g = probs.to(hidden.dtype)
            del logits, probs
            grad_hidden[s : s + chunk] = g @ weight
            grad_weight.addmm_(g.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss / count

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        grad_hidden, grad_weight = ctx.saved_tensors
        g = grad_out.to(grad_hidden.dtype)
        return grad_hidden * g, grad_weight * g, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = 2048
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `labels` (IGNORE_INDEX rows excluded), in fp32."""
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk)


@dataclass
class LMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor | None


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
