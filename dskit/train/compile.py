"""Regional torch.compile: the token-sized elementwise code of DeepSeek's decoder, fused.

Eager PyTorch runs RMSNorm as six kernels with an fp32 copy of the hidden state kept for backward, the
shared experts' SwiGLU as three, and DeepSeek-V2's rotary embedding through complex tensors. Compiled,
each becomes one or two kernels that keep less for backward; it pays where the step is GPU-bound, not
where it is host-bound (bench/README.md "Regional torch.compile on one H200"). Only the math is compiled:
the regions take the weights ZeRO-3 has already gathered as inputs, so its module hooks run outside
them, as before.

`overrides.compile` (plan: `parallel.compile_regions`): on by default on GPUs, where the planner counts
what it saves (`dskit/plan/memory.py` `compiled_saving_per_token_layer`, `dskit/plan/speed.py`
`COMPILED_COMPUTE_SAVING`); off on the cpu profile.
"""

from __future__ import annotations

import logging
import sys
import types

import torch
import torch.nn.functional as F

from dskit.data.sampler import PAD_BUCKETS

log = logging.getLogger("dskit.train")


@torch.compile(dynamic=False)
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)  # as transformers' DeepSeek RMSNorm: the cast before the weight


@torch.compile(dynamic=False)
def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@torch.compile(dynamic=False)
def _rope(xq: torch.Tensor, xk: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # (a + ib)(c + id) in real arithmetic: inductor generates no complex kernels
    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float().reshape(*x.shape[:-1], -1, 2)
        a, b, c, d = xf[..., 0], xf[..., 1], f[..., 0], f[..., 1]
        return torch.stack((a * c - b * d, a * d + b * c), dim=-1).flatten(3).type_as(x)

    return rot(xq), rot(xk)


def _apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    """transformers' DeepSeek-V2 apply_rotary_emb (complex freqs_cis), through `_rope`."""
    return _rope(xq, xk, torch.view_as_real(freqs_cis.unsqueeze(1).to(xq.device)))


def _rms_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return _rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x)))


def compile_regions(
    model: torch.nn.Module, *, attention: bool = False, cuda_graphs: bool = False
) -> dict[str, int]:
    """Route the model's RMSNorms, SwiGLU MLPs (shared experts, dense layers) and DeepSeek-V2 rotary
    embedding through the compiled functions above, and with `attention` (plan: `compile_attention`,
    ZeRO-1/2) compile each whole attention block, replayed as CUDA graphs with `cuda_graphs` (plan:
    `cuda_graphs`); returns how many of each were routed."""
    mode = "reduce-overhead" if cuda_graphs else None
    done = {"rms_norm": 0, "swiglu_mlp": 0, "rotary": 0, "attention": 0, "cuda_graphs": 0}
    # Each function compiles once per input shape and grad mode: RMSNorm alone sees up to three widths
    # (hidden, kv_lora_rank, q_lora_rank) in training and in eval, 6 of dynamo's default 8 entries for
    # one row width. `pad` rows come in PAD_BUCKETS widths; without room for all of them the later
    # ones would run eager, with more memory than the plan counts.
    limit = 8 * PAD_BUCKETS
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    modules = set()
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RMSNorm") and hasattr(m, "weight") and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_rms_forward, m)
            done["rms_norm"] += 1
        elif (
            all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj"))
            and getattr(getattr(m, "config", None), "hidden_act", None) == "silu"
        ):
            m.forward = types.MethodType(_mlp_forward, m)
            done["swiglu_mlp"] += 1
        elif attention and name.endswith("Attention"):
            # the projections, splits, rotary and SDPA call as one graph: under ZeRO-1/2 no module hooks
            # run inside it (ZeRO-3's would break it apart); its norms and rotary are inside the graph
            m.forward = torch.compile(m.forward, dynamic=False, mode=mode)
            done["attention"] += 1
            done["cuda_graphs"] += cuda_graphs
        modules.add(type(m).__module__)
    for mod in modules:  # the modeling module's own function, which its attention calls by name
        if mod.endswith("modeling_deepseek_v2") and hasattr(sys.modules[mod], "apply_rotary_emb"):
            sys.modules[mod].apply_rotary_emb = _apply_rotary_emb
            done["rotary"] += 1
    log.info("regional torch.compile: %s", ", ".join(f"{k} x{v}" for k, v in done.items()))
    return done


def cuda_graph_skips() -> int:
    """How many compiled graphs inductor has run without their CUDA graph in this process (a graph it could
    not capture: a CPU tensor, a mutated input, a dynamic shape; TORCH_LOGS=perf_hints says which)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])
