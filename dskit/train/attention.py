"""FlashAttention for MLA, plain and packed rows, as transformers attention functions.

Why dskit's own functions rather than transformers' `flash_attention_2` / `_4`:
- packed rows: transformers derives per-sample boundaries from the position ids only when a batch has
  one row (modeling_flash_attention_utils.py `_is_packed_sequence`: `batch_size != 1` -> not packed);
  at micro-batch > 1 it runs plain causal attention over the whole row, and the samples packed into it
  attend to each other. Here the boundaries come from the batch itself for any micro-batch.
- head dims: it pads V from 128 to the q/k head dim 192 for every flash kernel; FA4 takes DeepSeek's
  192/128 natively on sm90 (flash_attn/cute/interface.py `_validate_head_dims`), FA2 needs the padding.
On packed rows this matters most: a varlen kernel skips the attention between samples, where cuDNN with
the dense block-diagonal mask transformers builds computes it and masks it out, which measured more
than ten times slower (bench/attention_bench.py; the figures in bench/README.md). FA2 (sm80/86/89) is
not measured: no such GPU is lent.

Packed rows: the kernels need each sample's cumulative start (`cu_seqlens`) and the longest sample. The
training loop derives them on the host from the batch's position ids (`packed_rows`, no GPU sync) and
holds them for the micro-step's forward *and* backward (`rows_of`): activation checkpointing re-runs the
attention forward inside the backward, on the autograd engine's device thread, and it must attend
within the same samples. They travel beside
the model call, not through it, because the attention blocks are torch.compile'd with static shapes
(dskit/train/compile.py): a cu_seqlens argument whose length changes with every batch would recompile
them each step. The kernel call itself is opaque to the compiler (`torch.compiler.disable`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from dskit.host.flash_kernels import KERNELS, probe

#: the transformers attention implementation each plan backend becomes. No "flash" in the names:
#: transformers treats any such name as its own FlashAttention integration (it would try to import a
#: kernel by that name, and pad V to 192 in DeepSeek's attention).
REGISTERED = {"flash_attention_4": "dskit_fa4", "flash_attention_2": "dskit_fa2"}


def kernels_missing(backend: str) -> str | None:
    """Why `backend`'s kernels cannot run here, or None: its distribution is installed and imports."""
    version, error = probe(backend)
    dist, module = KERNELS[backend]
    if version is None:
        return f"`{dist}` is not installed"
    return f"`{module}` does not import ({error})" if error else None


@dataclass(frozen=True)
class PackedRows:
    """Where each sample of a micro-batch starts, the micro-batch's rows laid end to end."""

    cu_seqlens: torch.Tensor  # int32, (samples + 1,), on the device
    max_len: int
    samples: int


class _Held:
    """The rows of the micro-step in flight, process-wide on purpose: not thread-local, because the
    autograd engine runs a CUDA backward (and so activation checkpointing's recompute of attention) on
    its own per-device worker thread, which must see the same samples as the forward did."""

    rows: PackedRows | None = None


_state = _Held()


def packed_rows(position_ids: np.ndarray | None, device: torch.device) -> PackedRows | None:
    """The sample boundaries of packed rows from their position ids (restart at 0 per sample), or None
    when every row is one sequence (text windows): then plain causal attention is exact."""
    if position_ids is None:
        return None
    flat = position_ids.reshape(-1)
    starts = np.flatnonzero(flat == 0)
    # a row always begins a sample, even one cut off from the previous row (its ids do not restart)
    row_starts = np.arange(0, flat.size, position_ids.shape[-1])
    starts = np.union1d(starts, row_starts)
    bounds = np.append(starts, flat.size).astype(np.int32)
    cu = torch.from_numpy(bounds).to(device, non_blocking=True)
    return PackedRows(cu_seqlens=cu, max_len=int(np.diff(bounds).max()), samples=len(starts))


@contextmanager
def rows_of(rows: PackedRows | None) -> Iterator[None]:
    """Attention inside this block (a micro-step's forward and backward) stays within `rows`' samples."""
    prev = _state.rows
    _state.rows = rows
    try:
        yield
    finally:
        _state.rows = prev


def _kernels(backend: str):
    """(plain, varlen, pads V): the kernel pair of a backend, imported on first use."""
    if backend == "flash_attention_4":
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        return flash_attn_func, flash_attn_varlen_func, False
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    return flash_attn_func, flash_attn_varlen_func, True  # FA2 needs equal q/k and v head dims


def _flash(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """(batch, seq, heads, d) in, (batch, seq, heads, dv) out; causal within each sample."""
    plain, varlen, pads_v = _kernels(backend)
    dv = v.shape[-1]
    if pads_v and dv != q.shape[-1]:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))
    rows = _state.rows
    if rows is None:
        out = plain(q, k, v, softmax_scale=scale, causal=True)
    else:
        b, s, h = q.shape[:3]
        out = varlen(
            *(t.reshape(b * s, h, t.shape[-1]) for t in (q, k, v)),
            cu_seqlens_q=rows.cu_seqlens,
            cu_seqlens_k=rows.cu_seqlens,
            max_seqlen_q=rows.max_len,
            max_seqlen_k=rows.max_len,
            softmax_scale=scale,
            causal=True,
        )
    out = out[0] if isinstance(out, tuple) else out
    return out.view(*q.shape[:3], -1)[..., :dv]


def _attention_function(backend: str):
    """transformers' attention-function signature: (batch, heads, seq, d) in, (batch, seq, heads, dv)
    out. Causal only, no dropout, no padding mask: what training here uses; anything else is refused."""

    @torch.compiler.disable
    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        return _flash(backend, q, k, v, scale)

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise ValueError(f"{backend}: a padding mask was passed; dskit's rows carry none")
        if dropout:
            raise ValueError(f"{backend}: attention dropout {dropout} is not supported")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return kernel(q, k, v, scaling), None

    attention.__name__ = attention.__qualname__ = REGISTERED[backend]
    return attention


@functools.cache
def function(backend: str):
    """`backend`'s attention function, built on first use: `torch.compiler.disable` imports torch._dynamo,
    a second of every rank's start, which a rank that never uses FlashAttention (the CPU's) does not pay."""
    return _attention_function(backend)


def register(backend: str) -> str:
    """Make `backend`'s function a transformers attention implementation (idempotent); returns its name."""
    from transformers import AttentionInterface

    # No mask function is registered for the name: transformers then builds no mask at all for it
    # (masking_utils.py `_preprocess_mask_arguments`), where a registered one would still scan the
    # position ids for packed samples on every forward, a device-to-host sync.
    name = REGISTERED[backend]
    AttentionInterface.register(name, function(backend))
    return name
