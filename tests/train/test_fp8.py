"""DeepSeek-V3's FP8 weights: a checkpoint in the FP8 block format trains full fine-tune
through the real trainer, dequantised while loading, from the same first loss as its BF16 twin; broken
FP8 checkpoints are one line and exit 2; the frozen FP8 linear computes what a bf16 linear with the
dequantised weight computes, holding 1 byte per weight.

The tiny V3 has dims over 128 that are not multiples of it (hidden 160, expert width 144), so edge
blocks are partial, where a block size read off the scale grid goes wrong (transformers' own
dequantisation does that: dskit/train/fp8/loading.py's docstring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dskit import catalog
from dskit.formats.hf_checkpoint import fp8_format
from dskit.train.fp8.blocks import Fp8Linear, dequantize_blocks, quantize_blocks
from tests.conftest import dskit, render_tiny
from tests.support.shared import built_once
from tests.train.test_train import losses, run

QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# tiny-v3 widened past one 128 block in both directions of most matrices, with partial edges
WIDE = {"hidden_size": 160, "moe_intermediate_size": 144, "intermediate_size": 272, "q_lora_rank": 136}


def _tiny_v3_state(train_steps: int = 20) -> tuple[dict, dict[str, torch.Tensor]]:
    """A widened tiny V3 trained a little (so its loss is far from a fresh init's), as (config, the
    published layout's tensors: per-expert gate/up/down as DeepSeek ships them)."""
    from transformers import AutoModelForCausalLM

    from dskit.data.sampler import Sampler
    from dskit.data.shards import TokenData
    from dskit.train.model import hf_config

    cfg = {**catalog.model("tiny-v3").config, **WIDE}
    torch.manual_seed(7)
    m = AutoModelForCausalLM.from_config(hf_config(cfg, "sdpa"))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sampler = Sampler(TokenData.open(None), 64, seed=7)
    for step in range(train_steps):
        batch = torch.from_numpy(sampler.batch(1000 + 8 * step, 8))
        m(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss.backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for name, t in m.state_dict().items():
        t = t.detach()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> per expert gate, up [I, H]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            out[name] = t
    return cfg, {k: v.contiguous() for k, v in out.items()}


def _quantized(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek-V3 ships in FP8: the projections and experts; not embeddings, norms, the router, lm_head."""
    return name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


def deepseek_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rule written independently of dskit's (scales spread over their blocks, edges cut):
    what the BF16 twin holds, and what the trainer must load from the FP8 checkpoint."""
    n, k = q.shape[-2:]
    full = s.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)[..., :n, :k]
    return (q.float() * full).to(torch.bfloat16)


def save_fp8_twins(root: Path) -> tuple[Path, Path]:
    """The same tiny V3 twice: in DeepSeek-V3's FP8 block format (weights quantised by DeepSeek's rule,
    two shards, each scale in the other shard from its weight) and as its dequantised BF16 twin."""
    from safetensors.torch import save_file

    cfg, state = _tiny_v3_state()
    fp8, bf16 = {}, {}
    for name, t in state.items():
        if _quantized(name, t):
            q, s = quantize_blocks(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            bf16[name] = deepseek_dequant(q, s)
        else:
            fp8[name] = bf16[name] = t.to(torch.bfloat16)
    assert any(s.shape[-1] == 2 for n, s in fp8.items() if n.endswith("_scale_inv"))  # partial blocks exist
    dirs = (root / "v3-fp8", root / "v3-bf16")
    for d, tensors, quant in ((dirs[0], fp8, QUANT), (dirs[1], bf16, None)):
        d.mkdir(parents=True)
        config = {**cfg, "architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": "bfloat16"}
        if quant:
            config["quantization_config"] = quant
        (d / "config.json").write_text(json.dumps(config))
        shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
        a, b = shards.values()
        for name, t in tensors.items():
            (b if name.endswith("_scale_inv") or "embed" in name else a)[name] = t
        weight_map = {}
        for f, part in shards.items():
            save_file(part, d / f, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, f))
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    return dirs


def shared_fp8_twins(tmp_path_factory) -> tuple[Path, Path]:
    """save_fp8_twins' two checkpoints, trained and written once per run for every module that reads them
    (tests/support/shared.py): a test must copy them before changing them."""
    d = built_once(tmp_path_factory, "fp8-twins", save_fp8_twins)
    return d / "v3-fp8", d / "v3-bf16"


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> tuple[Path, Path]:
    return shared_fp8_twins(tmp_path_factory)


# ---------------------------------------------------------------------------------------------------
# detection and validation (torch-free, in dskit/formats/hf_checkpoint.py)


def test_the_fp8_format_is_detected_and_the_bf16_twin_is_not(twins):
    fp8, bf16 = twins
    fmt = fp8_format(str(fp8))
    assert fmt is not None and fmt.block == (128, 128)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in fmt.weights
    assert "model.embed_tokens.weight" not in fmt.weights
    assert fp8_format(str(bf16)) is None


W = "model.layers.0.self_attn.o_proj.weight"


def _small_fp8_dir(
    d: Path, *, quant: dict | None = QUANT, drop: str = "", replace: dict | None = None
) -> Path:
    """A config.json and one shard in the FP8 format (shapes need not fit the model: detection reads
    headers), broken as asked: `drop` a tensor, `replace` some, or another quantization_config."""
    from safetensors.torch import save_file

    d.mkdir()
    q, s = quantize_blocks(torch.randn(160, 144))
    tensors = {
        W: q,
        W + "_scale_inv": s,
        "model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
    }
    tensors = {k: v for k, v in {**tensors, **(replace or {})}.items() if k != drop}
    cfg = dict(catalog.model("tiny-v3").config)
    if quant is not None:
        cfg["quantization_config"] = quant
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, d / "model.safetensors")
    return d


BROKEN = {
    "block size": (
        {"quant": {**QUANT, "weight_block_size": [64, 64]}},
        "quantization_config.weight_block_size in {d}/config.json is [64, 64]; DeepSeek-V3's FP8 format has [128, 128]",
    ),
    "fmt": ({"quant": {**QUANT, "fmt": "e5m2"}}, "quantization_config.fmt in {d}/config.json is 'e5m2'"),
    "method": (
        {"quant": {"quant_method": "bitsandbytes"}},
        "quantization_config.quant_method in {d}/config.json",
    ),
    "missing scale": ({"drop": W + "_scale_inv"}, f"{{d}}: {W} is FP8 but {W}_scale_inv is missing"),
    "scale shape": (
        {"replace": {W + "_scale_inv": torch.ones(1, 2)}},
        f"{{d}}: {W}_scale_inv is F32 [1, 2]; {W} [160, 144] needs F32 [2, 2] (one scale per 128 x 128 block)",
    ),
    "scale dtype": (
        {"replace": {W + "_scale_inv": torch.ones(2, 2, dtype=torch.bfloat16)}},
        f"{W}_scale_inv is BF16 [2, 2]",
    ),
    "weight not fp8": (
        {"replace": {W: torch.zeros(160, 144, dtype=torch.bfloat16)}},
        f"{{d}}: {W}_scale_inv scales {W}, which is BF16, not F8_E4M3",
    ),
    "weight e5m2": (
        {"replace": {W: torch.zeros(160, 144).to(torch.float8_e5m2)}},
        f"{{d}}: {W} is F8_E5M2; FP8 weights must be F8_E4M3",
    ),
    "no config entry": (
        {"quant": None},
        "holds FP8 tensors (e.g. {W}) but its config.json has no quantization_config",
    ),
}


def test_a_valid_small_fp8_dir_plans(tmp_path):
    d = _small_fp8_dir(tmp_path / "ok")
    assert fp8_format(str(d)).weights == {W}
    r = dskit("plan", "--gpu", "cpu", "--set", f"model.path={d}", "--set", "training.seq_len=128")
    assert r.returncode == 0, r.stderr


def test_detection_reads_headers_without_importing_torch(tmp_path):
    """The plan and the CLI call it, and they stay torch-free (tests/test_layers.py's boundaries)."""
    import subprocess
    import sys

    d = _small_fp8_dir(tmp_path / "ok")
    code = (
        "import sys\nfrom dskit.formats.hf_checkpoint import fp8_format\n"
        f"assert sorted(fp8_format({str(d)!r}).weights) == [{W!r}]\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_fp8_checkpoint_is_one_line_exit_2_and_nothing_written(tmp_path, case):
    kwargs, want = BROKEN[case]
    d = _small_fp8_dir(tmp_path / "ckpt", **kwargs)
    out = tmp_path / "out"
    sets = ["--set", f"model.path={d}", "--set", "training.seq_len=128"]
    r = dskit("render", "slurm", "--gpu", "cpu", *sets, "-o", str(out))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("dskit: error: model.path: ")
    assert want.format(d=d, W=W) in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.train
def test_an_fp8_checkpoint_broken_after_render_stops_every_rank_at_start(tmp_path):
    """The trainer checks the format again before loading (files change between render and start)."""
    from safetensors.torch import load_file, save_file

    d = _small_fp8_dir(tmp_path / "ckpt")
    rd = render_tiny(tmp_path, None, steps=1, extra=[f"model.path={d}"])
    tensors = load_file(d / "model.safetensors")
    tensors[W + "_scale_inv"] = torch.ones(2, 1)
    save_file(tensors, d / "model.safetensors")
    r = dskit("train", "--local", str(rd))
    assert r.returncode == 2, r.stdout[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("dskit: error: model.path:")]
    assert len(errors) == 2 and all(f"{W}_scale_inv is F32 [2, 1]" in e for e in errors), r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------
# full fine-tuning: dequantised while loading (dskit/train/fp8/loading.py), through the real trainer


def _losses(tmp: Path, ckpt: Path, name: str, extra: tuple[str, ...] = ()) -> list[float]:
    """The losses of a 2-step run of the tiny plan (ZeRO-3, 2 ranks, unless `extra` says otherwise)."""
    rd = render_tiny(tmp, None, steps=2, name=name, extra=[f"model.path={ckpt}", *extra])
    log = tmp / f"{name}.log"
    assert run(rd, log) == 0, log.read_text()[-4000:]
    got = losses(rd)
    return [got[1], got[2]]


@pytest.fixture(scope="module")
def twin_losses(tmp_path_factory, twins) -> list[float]:
    """The BF16 twin's two losses under the default tiny plan: what every FP8 run must match."""
    return _losses(tmp_path_factory.mktemp("bf16-run"), twins[1], "bf16")


@pytest.mark.train
def test_full_fine_tuning_from_fp8_trains_as_its_bf16_twin_does(tmp_path, twins, twin_losses):
    """ZeRO-3 on 2 ranks: rank 0 dequantises each tensor as the partitioned model is filled, one layer
    at a time. Both runs hold bit-identical bf16 weights, so the first loss, and after an optimizer
    step the second, agree (measured: equal); reading the block size off the scale grid, as
    transformers does, moves the first by 3e-3."""
    assert _losses(tmp_path, twins[0], "fp8") == pytest.approx(twin_losses, rel=1e-5)


@pytest.mark.train
def test_zero1_loads_fp8_whole_onto_each_rank_dequantised(tmp_path, twins, twin_losses):
    """ZeRO-1/2 take the other loader path (the whole model onto each rank's device, from safetensors
    slices): the same weights, the same first loss (the second follows stage 1's own reduction order)."""
    got = _losses(tmp_path, twins[0], "fp8-z1", ("overrides.zero_stage=1",))
    assert got[0] == pytest.approx(twin_losses[0], rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# the frozen FP8 linear (dskit/train/fp8/blocks.py), the LoRA base


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (3, 150, 140), (24, 160)])
def test_dequantisation_follows_deepseeks_rule_on_whole_and_partial_blocks(shape):
    torch.manual_seed(5)
    w = torch.randn(shape)
    q, s = quantize_blocks(w)
    assert list(s.shape) == [*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128)]
    assert torch.equal(dequantize_blocks(q, s), deepseek_dequant(q, s))
    # and the quantiser is DeepSeek's: each block's largest magnitude lands on e4m3's largest value
    assert (q.float().abs().amax() == 448).item()
    torch.testing.assert_close(dequantize_blocks(q, s, dtype=torch.float32), w, rtol=0.07, atol=0.02)


def _fp8_and_bf16_linear(n: int = 300, k: int = 200) -> tuple[Fp8Linear, torch.nn.Linear]:
    torch.manual_seed(3)
    q, s = quantize_blocks(torch.randn(n, k) / k**0.5)
    ref = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(deepseek_dequant(q, s))
    return Fp8Linear(q, s), ref


def test_the_fp8_linear_computes_what_the_bf16_linear_with_its_dequantised_weight_does():
    fp8, ref = _fp8_and_bf16_linear()
    assert torch.equal(fp8.dequantized(), ref.weight)
    x = torch.randn(2, 5, 200, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fp8(xa), ref(xb)
    torch.testing.assert_close(ya, yb)  # bf16 tolerance; the same GEMM on the same bf16 weight
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad)
    assert ref.weight.grad is not None and not list(fp8.parameters())  # frozen: nothing to train


def test_the_fp8_linear_holds_one_byte_per_weight_and_saves_no_dequantised_copy():
    n, k = 300, 200
    fp8, _ = _fp8_and_bf16_linear(n, k)
    held = {name: b.numel() * b.element_size() for name, b in fp8.named_buffers()}
    assert held == {"weight": n * k, "weight_scale_inv": 4 * 3 * 2}
    assert fp8.state_dict() == {}  # non-persistent: a checkpoint of the module holds none of the base
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    x = torch.randn(4, k, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fp8(x).sum().backward()
    assert sorted(saved, key=str) == sorted([(torch.float8_e4m3fn, n * k), (torch.float32, 6)], key=str)


def test_swapping_in_fp8_linears_reads_them_from_the_checkpoint(twins):
    """On a meta-device model (nothing allocated), every nn.Linear the checkpoint holds in FP8 becomes
    an Fp8Linear with the checkpoint's bytes; the routed experts (fused, not nn.Linear) are left alone."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from dskit.train.fp8.loading import swap_in_fp8_linears

    fp8 = twins[0]
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(fp8))
    swapped = swap_in_fp8_linears(m, str(fp8))
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in swapped and "lm_head" not in swapped
    assert all(".experts." not in n for n in swapped)
    layer = m.get_submodule("model.layers.1.self_attn.q_b_proj")
    assert isinstance(layer, Fp8Linear) and layer.weight.device.type == "cpu"
    name = "model.layers.1.self_attn.q_b_proj.weight"
    with safe_open(fp8 / "model-00001-of-00002.safetensors", framework="pt") as f:
        assert torch.equal(layer.weight.view(torch.uint8), f.get_tensor(name).view(torch.uint8))


def test_under_zero3_rank_0_dequantises_one_decoder_layer_at_a_time(twins, monkeypatch):
    """What transformers' ZeRO-3 loader is handed, call by call: one layer's tensors, its FP8 weights
    dequantised (bf16 tensors) except the per-expert ones, which stay deferred for its converters."""
    import transformers.modeling_utils as mu
    from transformers import AutoConfig, AutoModelForCausalLM

    from dskit.train.fp8.loading import Fp8Weight, fp8_state_dict, zero3_loads_layer_by_layer

    calls = []

    def loader(
        model, group, load_config=None
    ):  # stands where transformers' loader is, records, loads nothing
        calls.append(
            {k: type(v).__name__ if isinstance(v, Fp8Weight) else str(v.dtype) for k, v in group.items()}
        )
        return [], set()

    fp8 = twins[0]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(fp8))
    monkeypatch.setattr(mu, "_load_state_dict_into_zero3_model", loader)
    with fp8_state_dict(str(fp8), fp8_format(str(fp8)), dtype=torch.bfloat16, values="tensor") as sd:
        with zero3_loads_layer_by_layer():
            mu._load_state_dict_into_zero3_model(model, sd)
    assert len(calls) == 1 + 3  # embeddings, final norm and lm_head; then the three decoder layers
    assert set(calls[0]) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i, got in enumerate(calls[1:]):
        assert all(f".layers.{i}." in k for k in got)
        assert got[f"model.layers.{i}.self_attn.o_proj.weight"] == "torch.bfloat16"
        experts = [v for k, v in got.items() if ".mlp.experts." in k]
        assert experts == ([] if i == 0 else ["Fp8Weight"] * 8 * 3)  # layer 0 is dense
    assert sum(len(c) for c in calls) == len(sd)
