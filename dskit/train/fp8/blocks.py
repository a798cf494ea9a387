"""DeepSeek-V3's FP8 block format in torch: dequantise, quantise, and a frozen FP8 linear layer.

The format (config.json `quantization_config` and DeepSeek-V3's inference/kernel.py): an e4m3 weight
W8 [..., N, K] and a float32 `weight_scale_inv` S [..., ceil(N/128), ceil(K/128)], one per 128 x 128
block, the blocks at the right and bottom edges partial. Despite its name the scale is multiplied:
W[i, j] = float(W8[i, j]) * S[i // 128, j // 128], computed in float32 and then rounded to the model's
dtype, as `weight_dequant_kernel` does. Everything here is plain torch, so it runs (and is tested) on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dskit.formats.hf_checkpoint import FP8_BLOCK

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(float8_e4m3fn).max: the largest e4m3 value, what a block's amax maps to


def _blocked(x: torch.Tensor, grid: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """x [..., N, K] as float32 [..., grid0, block0, grid1, block1], zero-padded to whole blocks, so that
    a block's scale broadcasts over it in one multiply (no Python loop over blocks)."""
    *lead, n, k = x.shape
    pad_k, pad_n = grid[1] * block[1] - k, grid[0] * block[0] - n
    x = x.to(torch.float32)
    if pad_k or pad_n:
        x = F.pad(x, (0, pad_k, 0, pad_n))
    return x.reshape(*lead, grid[0], block[0], grid[1], block[1])


def block_grid(shape: torch.Size | tuple[int, ...], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, ...]:
    """The scale shape of a weight: its leading dims, then ceil(N / block0), ceil(K / block1)."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def dequantize_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """DeepSeek's rule: each e4m3 value times its block's float32 scale_inv, in float32, cast to `dtype`.
    Peak memory is two float32 copies of the weight (the padded blocks and the product) plus the result."""
    *lead, n, k = weight.shape
    grid = tuple(scale_inv.shape[-2:])
    if tuple(scale_inv.shape) != block_grid(weight.shape, block):
        raise ValueError(
            f"scale_inv {list(scale_inv.shape)} does not fit weight {list(weight.shape)} in {block} blocks"
        )
    x = _blocked(weight, grid, block)
    x.mul_(scale_inv.to(torch.float32)[..., :, None, :, None])
    x = x.reshape(*lead, grid[0] * block[0], grid[1] * block[1])[..., :n, :k]
    return x.to(dtype).contiguous()


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale_inv) by DeepSeek's rule: scale_inv = block amax / 448 and
    weight / scale_inv rounded to e4m3. An all-zero block keeps scale 1 (nothing to divide)."""
    grid = block_grid(weight.shape, block)[-2:]
    x = _blocked(weight, grid, block)
    scale = x.abs().amax(dim=(-3, -1)) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / scale[..., :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    *lead, n, k = weight.shape
    q = q.reshape(*lead, grid[0] * block[0], grid[1] * block[1])[..., :n, :k]
    return q.to(E4M3).contiguous(), scale.contiguous()


class Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T with W dequantised per block for the GEMM and dropped after it: autograd saves only the
    e4m3 weight and its scales (1 byte per weight), backward dequantises again for the input gradient.
    The weight is frozen, so there is no weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, scale_inv, block):
        ctx.block = block
        ctx.save_for_backward(weight, scale_inv)
        return F.linear(x, dequantize_blocks(weight, scale_inv, block, x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        weight, scale_inv = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ dequantize_blocks(weight, scale_inv, ctx.block, grad_out.dtype)
        return grad_x, None, None, None


class Fp8Linear(nn.Module):
    """A frozen linear layer kept in FP8 (the base under LoRA adapters): `weight` e4m3 [out, in] and
    `weight_scale_inv` float32, both non-persistent buffers. Buffers, not parameters: DeepSpeed casts
    float32 parameters to bf16 (which would round the scales) and hands parameters to the optimizer;
    buffers stay out of the optimizer and of dskit's checkpoints (the base is re-read from model.path)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale_inv: torch.Tensor,
        bias: torch.Tensor | None = None,
        block: tuple[int, int] = FP8_BLOCK,
    ) -> None:
        super().__init__()
        if weight.dtype != E4M3 or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D {E4M3}, not {weight.dtype} {list(weight.shape)}")
        if tuple(scale_inv.shape) != block_grid(weight.shape, block) or scale_inv.dtype != torch.float32:
            raise ValueError(f"weight_scale_inv must be float32 {list(block_grid(weight.shape, block))}")
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("weight_scale_inv", scale_inv, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = Fp8LinearFunction.apply(x, self.weight, self.weight_scale_inv, self.block)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight as the model's dtype would hold it (for merging adapters, or comparing)."""
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 block={self.block}"
        )
