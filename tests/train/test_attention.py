"""FlashAttention-4 wiring that runs without a GPU: where packed rows' samples start (the kernel's
cu_seqlens), that the boundaries hold for a whole micro-step and no longer, and that the plan's
`flash_attention_4` becomes dskit's registered function. The kernel itself is measured on the H200
(bench/attention_bench.py); the CPU trainer runs SDPA with transformers' block-diagonal mask, whose
logits tests/data/test_data.py holds equal to each sample run alone."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dskit.train import attention
from dskit.train.model import hf_config, resolve_attention

CPU = torch.device("cpu")


def _rows(*samples_per_row: list[int]) -> np.ndarray:
    """Position ids of packed rows: each sample counts 0..len-1."""
    return np.stack([np.concatenate([np.arange(n) for n in row]) for row in samples_per_row])


def test_samples_start_where_positions_restart():
    rows = attention.packed_rows(_rows([3, 5], [2, 2, 4]), CPU)
    assert rows.cu_seqlens.tolist() == [0, 3, 8, 10, 12, 16]
    assert rows.cu_seqlens.dtype == torch.int32  # what the varlen kernel takes
    assert (rows.samples, rows.max_len) == (5, 5)


def test_a_row_starts_a_sample_even_when_its_positions_do_not_restart():
    """A row that begins mid-sequence (ids not restarting at 0) must not attend into the row before it,
    which it follows in the flattened (batch x seq) layout the varlen kernel sees."""
    pos = np.array([[0, 1, 2, 3], [7, 8, 0, 1]])
    assert attention.packed_rows(pos, CPU).cu_seqlens.tolist() == [0, 4, 6, 8]


def test_padding_is_one_more_sample():
    """`pack` rows end in padding that counts its own positions from 0 (dskit/data/sampler.py): one
    label-less sample, not one per padded position."""
    rows = attention.packed_rows(_rows([6, 2]), CPU)
    assert rows.cu_seqlens.tolist() == [0, 6, 8] and rows.samples == 2


def test_text_windows_need_no_boundaries():
    assert attention.packed_rows(None, CPU) is None


def test_boundaries_hold_inside_the_block_only_and_for_every_thread():
    """Held for the block and no longer (a failed step included), and seen from other threads: the
    autograd engine runs a CUDA backward, where checkpointing recomputes attention, on its own
    per-device thread (a thread-local would hand the recompute no boundaries: silently wrong grads)."""
    outer = attention.packed_rows(_rows([2, 2]), CPU)
    inner = attention.packed_rows(_rows([4]), CPU)
    seen = []
    with attention.rows_of(outer):
        with attention.rows_of(inner):
            assert attention._state.rows is inner
        assert attention._state.rows is outer
        t = threading.Thread(target=lambda: seen.append(attention._state.rows))
        t.start()
        t.join()
        with pytest.raises(RuntimeError):
            with attention.rows_of(inner):
                raise RuntimeError("a failed step")
        assert attention._state.rows is outer  # restored on the way out of a failure too
    assert attention._state.rows is None and seen == [outer]


@pytest.mark.parametrize("backend", ["flash_attention_4", "flash_attention_2"])
def test_the_plan_name_maps_to_dskits_function(backend):
    pytest.importorskip("transformers")
    from transformers import AttentionInterface

    config = hf_config({"model_type": "deepseek_v2", "hidden_size": 64, "num_attention_heads": 2}, backend)
    assert config._attn_implementation == attention.REGISTERED[backend]
    assert "flash" not in config._attn_implementation  # else transformers' own flash path takes over
    assert AttentionInterface._global_mapping[config._attn_implementation] is attention.function(backend)


def test_the_function_refuses_what_training_never_passes():
    q = torch.zeros(1, 2, 4, 8)
    fn = attention.function("flash_attention_4")
    with pytest.raises(ValueError, match="padding mask"):
        fn(None, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout"):
        fn(None, q, q, q, None, dropout=0.1)


def test_kernels_are_found_by_distribution_not_by_module(tmp_path, monkeypatch):
    """flash-attn 2.8.3 bundles an old `flash_attn/cute` that needs FA4's dependencies: an image with
    FA2 alone must read as lacking FlashAttention-4 (a fallback with a warning), not as having it (an
    ImportError at the first forward)."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text('__version__ = "2.8.3"\n')
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("raise ModuleNotFoundError('cuda')\n")
    info = tmp_path / "flash_attn-2.8.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn\nVersion: 2.8.3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    assert attention.kernels_missing("flash_attention_4") == "`flash-attn-4` is not installed"
    assert attention.kernels_missing("flash_attention_2") is None
    (tmp_path / "flash_attn" / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
    sys.modules.pop("flash_attn", None)
    assert "does not import (undefined symbol" in attention.kernels_missing("flash_attention_2")


def test_off_cuda_the_trainer_says_it_falls_back():
    backend, why = resolve_attention("flash_attention_4", CPU)
    assert backend == "sdpa" and "needs a CUDA device" in why


def _reference_kernels(equal_dims: bool):
    """FlashAttention's two entry points (plain and varlen, same keywords), exact on CPU through SDPA;
    `equal_dims` asserts what FA2 requires of its inputs (q/k and v head dims equal)."""

    def attend(q, k, v, scale):  # (seq, heads, d)
        assert not equal_dims or q.shape[-1] == v.shape[-1], "FA2 takes equal head dims only"
        qq, kk, vv = (t.transpose(0, 1) for t in (q, k, v))
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale).transpose(0, 1)

    def plain(q, k, v, softmax_scale=None, causal=False):
        assert causal
        return torch.stack([attend(q[i], k[i], v[i], softmax_scale) for i in range(q.shape[0])])

    def varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False
    ):
        assert causal and cu_seqlens_q is cu_seqlens_k and cu_seqlens_q.dtype == torch.int32
        bounds = cu_seqlens_q.tolist()
        assert max_seqlen_q == max(e - a for a, e in zip(bounds, bounds[1:], strict=False))
        return torch.cat(
            [attend(q[a:e], k[a:e], v[a:e], softmax_scale) for a, e in zip(bounds, bounds[1:], strict=False)]
        )

    return plain, varlen, equal_dims


@pytest.mark.parametrize("backend", ["flash_attention_4", "flash_attention_2"])
def test_packed_rows_through_dskits_function_match_the_masked_model(monkeypatch, backend):
    """The whole path but the kernels: tiny DeepSeek-V2 (MLA: q/k head dim != v head dim) with dskit's
    function, FlashAttention's kernels replaced by exact CPU references, gives the logits transformers'
    dense block-diagonal mask gives, at micro-batch 2 (where transformers' own flash path would let
    the samples of a row attend to each other); without the held boundaries the samples do."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from dskit import catalog

    monkeypatch.setattr(attention, "_kernels", lambda b: _reference_kernels(b == "flash_attention_2"))
    torch.manual_seed(0)
    cfg = catalog.model("tiny-v2").config
    assert cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] != cfg["v_head_dim"]
    model = AutoModelForCausalLM.from_config(hf_config(cfg, "sdpa")).eval()
    model.config.use_cache = False
    pos = _rows([20, 30, 14], [40, 24])
    ids = torch.randint(0, cfg["vocab_size"], pos.shape)
    with torch.no_grad():
        masked = model(input_ids=ids, position_ids=torch.from_numpy(pos)).logits
        model.set_attn_implementation(attention.register(backend))
        with attention.rows_of(attention.packed_rows(pos, CPU)):
            flash = model(input_ids=ids, position_ids=torch.from_numpy(pos)).logits
        crossing = model(input_ids=ids, position_ids=torch.from_numpy(pos)).logits  # no boundaries held
    torch.testing.assert_close(flash, masked, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(crossing, masked, rtol=1e-4, atol=1e-4)


def test_checkpointed_backward_on_another_thread_gets_the_masked_models_gradients(monkeypatch):
    """As on a GPU: the loss's backward runs on a thread other than the forward's (the autograd
    engine's device thread), and activation checkpointing recomputes attention there. Inside the
    micro-step's `rows_of` block the recompute attends within the same samples, so the gradients equal
    the dense-mask model's."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from dskit import catalog

    monkeypatch.setattr(attention, "_kernels", lambda b: _reference_kernels(False))
    cfg = catalog.model("tiny-v2").config
    pos = _rows([20, 30, 14], [40, 24])
    ids = torch.randint(0, cfg["vocab_size"], pos.shape, generator=torch.Generator().manual_seed(1))

    def grads(backend: str | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config(cfg, "sdpa"))
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        if backend:
            model.set_attn_implementation(attention.register(backend))
        with attention.rows_of(attention.packed_rows(pos, CPU) if backend else None):
            loss = model(input_ids=ids, position_ids=torch.from_numpy(pos), labels=ids).loss
            failed = []

            def backward() -> None:
                try:
                    loss.backward()
                except BaseException as e:  # re-raised below: a thread's exception would be lost
                    failed.append(e)

            t = threading.Thread(target=backward)
            t.start()
            t.join()
            if failed:
                raise failed[0]
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    masked, flash = grads(None), grads("flash_attention_4")
    assert masked.keys() == flash.keys() and len(masked) > 10
    for name in masked:
        torch.testing.assert_close(flash[name], masked[name], rtol=1e-4, atol=1e-5, msg=name)
