"""A lever under measurement (issue 13), not a trainer feature: regional torch.compile of DeepSeek-V2's
token-sized elementwise code (RMSNorm, the shared experts' SwiGLU, rotary embedding), patched into
transformers at interpreter start when DSKIT_BENCH_COMPILE=1 and this directory is on PYTHONPATH
(`bench/train_bench.py --compile`). The compiled regions take the already gathered weights as inputs,
so ZeRO-3's module hooks stay outside them. It becomes trainer code only if it wins."""

import os

if os.environ.get("DSKIT_BENCH_COMPILE") == "1":
    import torch
    import torch.nn.functional as F
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

    @torch.compile(dynamic=False)
    def _rms(x, w, eps: float):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return w * x.to(dtype)

    def _rms_forward(self, hidden_states):
        return _rms(hidden_states, self.weight, self.variance_epsilon)

    @torch.compile(dynamic=False)
    def _swiglu(gate, up):
        return F.silu(gate) * up

    def _mlp_forward(self, x):
        return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x)))

    @torch.compile(dynamic=False)
    def _rope(xq, xk, f):
        # (a + ib)(c + id) in real arithmetic: inductor does not generate complex kernels
        def rot(x):
            xf = x.float().reshape(*x.shape[:-1], -1, 2)
            a, b, c, d = xf[..., 0], xf[..., 1], f[..., 0], f[..., 1]
            return torch.stack((a * c - b * d, a * d + b * c), dim=-1).flatten(3).type_as(x)

        return rot(xq), rot(xk)

    def _apply_rotary_emb(xq, xk, freqs_cis):
        return _rope(xq, xk, torch.view_as_real(freqs_cis.unsqueeze(1).to(xq.device)))

    m.DeepseekV2RMSNorm.forward = _rms_forward
    if getattr(m.DeepseekV2MLP, "forward", None) is not None:
        m.DeepseekV2MLP.forward = _mlp_forward
    m.apply_rotary_emb = _apply_rotary_emb
    print("dskit bench: regional torch.compile patched in (RMSNorm, SwiGLU, rotary)", flush=True)
