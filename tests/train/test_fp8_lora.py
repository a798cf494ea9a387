"""LoRA on an FP8 frozen base: a tiny V3 saved in DeepSeek-V3's FP8 block format
(quantised by DeepSeek's rule, partial edge blocks: tests/train/test_fp8.py) trains with LoRA through the real
trainer (2 gloo ranks, AutoEP EP 2, ZeRO-2), its base held in FP8, against the same run on its
dequantised BF16 twin.

The two runs compute with bit-identical bf16 weights (the FP8 layers dequantise to exactly what the
twin holds), so their losses agree to the last bit, not merely within FP8 tolerance (measured: equal
at every step); what differs is what the device holds, which construction-rank0.json records.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dskit.formats.hf_checkpoint import fp8_format
from dskit.plan.schema import load_plan
from tests.conftest import dskit, render_tiny
from tests.train.test_fp8 import BROKEN, W, _small_fp8_dir, shared_fp8_twins
from tests.train.test_train import RESUME_RTOL, losses, run

STEPS, EVERY = 8, 4
SETS = [
    "finetune.method=lora",
    # everything FP8 that peft can wrap (attention, shared experts, the dense layer) and the router
    "finetune.lora.targets=[attention, shared_experts, dense_mlp, router]",
    "overrides.zero_stage=2",  # both runs at the stage an FP8 base trains under
    # layers 0 and 2 recomputed, 1 not: both MoE layers' ways of saving their experts for the backward
    "overrides.activation_checkpointing=2",
    f"checkpoint.every={EVERY}",
    "checkpoint.keep=10",
]


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> tuple[Path, Path]:
    return shared_fp8_twins(tmp_path_factory)


def _render(tmp: Path, ckpt: Path, name: str = "run", extra: tuple[str, ...] = ()) -> Path:
    return render_tiny(tmp, None, steps=STEPS, name=name, extra=[f"model.path={ckpt}", *SETS, *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, twins) -> dict[str, Path]:
    """ "fp8" and "bf16" -> the run dir of one uninterrupted LoRA run on that twin (base_precision auto)."""
    out = {}
    for name, ckpt in zip(("fp8", "bf16"), twins, strict=True):
        tmp = tmp_path_factory.mktemp(f"lora-{name}")
        rd = _render(tmp, ckpt)
        assert run(rd, tmp / "train.log") == 0, (tmp / "train.log").read_text()[-4000:]
        out[name] = rd
    return out


def _construction(rd: Path) -> dict:
    import json

    return json.loads(Path(load_plan(rd / "run.yaml").run.output_dir, "construction-rank0.json").read_text())


@pytest.mark.train
def test_base_precision_auto_is_fp8_on_the_fp8_checkpoint_only(runs):
    plan = load_plan(runs["fp8"] / "run.yaml")
    assert plan.finetune.base_precision == "fp8" and plan.parallel.activation_checkpointing == 2
    assert load_plan(runs["bf16"] / "run.yaml").finetune.base_precision == "bf16"


@pytest.mark.train
def test_the_fp8_base_trains_as_its_bf16_twin_does(runs, twins):
    """Step 1 (before any update) and every step after: the same losses, and the first is transformers +
    peft's on the twin. The loss moves: the merged model does better on step 1's batches than the base."""
    from transformers import AutoModelForCausalLM

    from dskit.train.lora.inject import attach
    from tests.support.hf_reference import first_step_loss
    from tests.train.test_weights import LOSS_RTOL

    got, want = losses(runs["fp8"]), losses(runs["bf16"])
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[1] == pytest.approx(want[1], rel=1e-6)
    assert got == pytest.approx(want, rel=1e-5)
    plan = load_plan(runs["fp8"] / "run.yaml")
    m = AutoModelForCausalLM.from_pretrained(twins[1], dtype=torch.bfloat16, local_files_only=True)
    attach(m, plan.finetune, seed=plan.run.seed, dtype=torch.bfloat16)
    assert got[1] == pytest.approx(first_step_loss(m, runs["fp8"]), rel=LOSS_RTOL)


@pytest.mark.train
def test_the_device_holds_the_frozen_base_in_fp8(runs, twins):
    """Every FP8 weight of the checkpoint is on the rank as its e4m3 bytes, the routed experts 1/ep of
    them (AutoEP's share); none of them also in bf16: the twin's bf16 bytes are the FP8 run's plus 2
    per FP8 weight. The plan's count of frozen bytes (dskit/plan/adapters.py) is what the trainer holds."""
    from dskit.plan import adapters
    from dskit.plan.model_math import counts
    from dskit.plan.shape import ModelShape
    from dskit.train.fp8.loading import open_shards

    fmt = fp8_format(str(twins[0]))
    ep = 2
    with open_shards(str(twins[0])) as shards:
        numel = {n: math.prod(shards[n].get_slice(n).get_shape()) for n in fmt.weights}
    want = sum(n // ep if ".experts." in name else n for name, n in numel.items())
    fp8, bf16 = _construction(runs["fp8"])["frozen_bytes"], _construction(runs["bf16"])["frozen_bytes"]
    assert fp8["float8_e4m3fn"] == want
    assert "float8_e4m3fn" not in bf16 and bf16["bfloat16"] == fp8["bfloat16"] + 2 * want
    plan = load_plan(runs["fp8"] / "run.yaml")
    f, shape = plan.finetune, ModelShape.from_config(plan.model.config)
    t = adapters.tuning(shape, counts(shape, plan.parallel.seq_len), targets=f.targets, r=f.r,
                        dropout=f.dropout, base_precision="fp8")  # fmt: skip
    assert sum(fp8.values()) == pytest.approx(t.frozen_weight_bytes(ep), rel=1e-3)


@pytest.mark.train
def test_a_checkpoint_holds_only_the_adapters_and_their_states(runs):
    plan = load_plan(runs["fp8"] / "run.yaml")
    tag = Path(plan.run.checkpoint_dir) / f"step{STEPS:08d}"
    files = {p.name: p.stat().st_size for p in tag.iterdir()}
    T = plan.finetune.trainable_params
    states = sum(files[n] for n in ("adapter.safetensors", "zero-rank0.pt", "zero-rank1.pt"))
    assert not [n for n in files if "model_states" in n or "optim_states" in n]
    assert 14 * T <= states < 14 * T + 256 * 2**10, (
        states,
        T,
    )  # as tests/train/test_lora.py: no frozen layer


@pytest.mark.train
def test_resume_from_a_checkpoint_continues_the_uninterrupted_run(runs, twins, tmp_path):
    again = _render(tmp_path, twins[0])
    tag = f"step{EVERY:08d}"
    src = Path(load_plan(runs["fp8"] / "run.yaml").run.checkpoint_dir) / tag
    dst = Path(load_plan(again / "run.yaml").run.checkpoint_dir) / tag
    shutil.copytree(src, dst)
    log = tmp_path / "train.log"
    assert run(again, log) == 0, log.read_text()[-4000:]
    assert f"resumed from {dst} (step {EVERY})" in log.read_text()
    got, want = losses(again), losses(runs["fp8"])
    assert sorted(got) == list(range(EVERY + 1, STEPS + 1))
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=RESUME_RTOL), (s, got[s], want[s])


@pytest.mark.train
def test_exports_dequantise_the_fp8_base(runs, twins, tmp_path, capsys):
    """The merged export is bf16 (the base dequantised, the adapters merged) with the trained logits and
    the twin run's tensors; the adapter loads in peft on the twin with the trained logits."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dskit.train.export import export

    out = export(str(runs["fp8"]), str(tmp_path / "hf"))
    assert "verified: exported logits match the trained model" in capsys.readouterr().out
    twin = export(str(runs["bf16"]), str(tmp_path / "twin-hf"))
    a = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(twin.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert a.keys() == b.keys() and {v.dtype for v in a.values()} <= {torch.bfloat16, torch.float32}
    assert all(torch.equal(a[k], b[k]) for k in a)
    dskit("export", str(runs["fp8"]), "-o", str(tmp_path / "adapter"), "--adapter-only", check=True)
    base = AutoModelForCausalLM.from_pretrained(twins[1], dtype=torch.bfloat16, local_files_only=True)
    probe = torch.load(
        Path(load_plan(runs["fp8"] / "run.yaml").run.checkpoint_dir) / f"step{STEPS:08d}" / "probe.pt",
        weights_only=False,
    )
    with torch.no_grad():
        logits = (
            PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=probe["input_ids"]).logits
        )
    err = ((logits.float() - probe["logits"]).norm() / probe["logits"].norm()).item()
    assert err < 2e-2, err


# ---------------------------------------------------------------------------------------------------
# construction, directly (no engine): from the meta device, no bf16 copy of the base anywhere


def test_the_fp8_base_is_built_from_the_meta_device_holding_only_what_trains(twins, tmp_path):
    """The FP8 linears hold the checkpoint's bytes, every other tensor is the bf16 twin's, the routed
    experts were never materialised (AutoEP + experts_stay_fp8 read each rank's share later), and
    nothing else is in bf16: what a rank holds after the build is the plan's non-expert FP8 base."""
    from transformers import AutoModelForCausalLM

    from dskit.plan import adapters
    from dskit.plan.model_math import counts
    from dskit.plan.shape import ModelShape
    from dskit.train.fp8.blocks import Fp8Linear
    from dskit.train.fp8.construct import FUSED_EXPERTS
    from dskit.train.fp8.frozen_base import held_bytes
    from dskit.train.model import build_model

    rd = render_tiny(tmp_path, None, extra=[f"model.path={twins[0]}", *SETS])
    plan = load_plan(rd / "run.yaml")
    m = build_model(
        plan.model, attention="sdpa", dtype=torch.bfloat16, seed=1, ckpt_every=0,
        deepspeed_config={"zero_optimization": {"stage": 2}}, device=torch.device("cpu"), fp8_base=True,
    )  # fmt: skip
    twin = AutoModelForCausalLM.from_pretrained(twins[1], dtype=torch.bfloat16, local_files_only=True)
    ref = twin.state_dict()
    meta = sorted(n for n, t in m.state_dict().items() if t.is_meta)
    assert meta and all(FUSED_EXPERTS.search(n) for n in meta)
    assert len(meta) == 2 * sum(1 for n in ref if n.endswith("mlp.experts.down_proj"))
    fp8 = {n: x for n, x in m.named_modules() if isinstance(x, Fp8Linear)}
    assert fp8 and all(torch.equal(x.dequantized(), ref[f"{n}.weight"]) for n, x in fp8.items())
    for n, t in m.state_dict().items():
        if not t.is_meta:
            assert t.dtype == ref[n].dtype and torch.equal(t, ref[n]), n
    rotary = dict(twin.named_buffers())["model.rotary_emb.inv_freq"]
    assert torch.equal(dict(m.named_buffers())["model.rotary_emb.inv_freq"], rotary)
    f, shape = plan.finetune, ModelShape.from_config(plan.model.config)
    t = adapters.tuning(shape, counts(shape, plan.parallel.seq_len), targets=f.targets, r=f.r,
                        dropout=f.dropout, base_precision="fp8")  # fmt: skip
    for n, q in m.named_parameters():  # what LoRA will freeze: all but the router, which SETS trains
        q.requires_grad_(bool(q.is_meta) or n.endswith("mlp.gate.weight"))
    assert sum(held_bytes(m).values()) == pytest.approx(t.other_bytes * t.frozen_other, rel=2e-3)


# ---------------------------------------------------------------------------------------------------
# the routed experts' parametrization, directly (no engine): FP8 original first, another may follow


def _grouped_experts_of_rank(fp8: Path, layer: str, ep_rank: int, local: int):
    """A GroupedExperts as AutoEP fills it for `ep_rank` (bf16, dequantised from the checkpoint)."""
    from deepspeed.moe.ep_experts import GroupedExperts

    from dskit.train.fp8.blocks import dequantize_blocks
    from dskit.train.fp8.frozen_base import EXPERT_PROJ
    from dskit.train.fp8.loading import open_shards

    fmt = fp8_format(str(fp8))
    with open_shards(str(fp8)) as shards:

        def weights(proj: str) -> torch.Tensor:
            names = [
                f"{layer}.experts.{e}.{proj}.weight" for e in range(ep_rank * local, (ep_rank + 1) * local)
            ]
            return torch.stack(
                [dequantize_blocks(shards[n].get_tensor(n), shards[fmt.scale_of(n)].get_tensor(fmt.scale_of(n)))
                 for n in names]
            )  # fmt: skip

        w = {attr: weights(proj) for attr, proj in EXPERT_PROJ.items()}
    g = GroupedExperts(w["w1"].shape[2], w["w1"].shape[1], local, use_grouped_mm=False)
    for attr, t in w.items():
        getattr(g, attr).data = t
        getattr(g, attr).requires_grad_(False)
    return g, fmt


class _Lora(torch.nn.Module):
    """What the routed-expert LoRA adds on top (W + s B A per expert): a second parametrization."""

    def __init__(self, e: int, n: int, k: int, r: int = 2) -> None:
        super().__init__()
        self.A = torch.nn.Parameter(torch.randn(e, r, k, dtype=torch.bfloat16))
        self.B = torch.nn.Parameter(torch.randn(e, n, r, dtype=torch.bfloat16))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + 0.5 * self.B @ self.A


def test_routed_experts_keep_the_checkpoints_fp8_bytes_under_a_parametrization_another_can_follow(twins):
    from torch.nn.utils import parametrize

    from dskit.train.fp8.frozen_base import DequantizedBlocks, requantize_experts
    from dskit.train.fp8.loading import open_shards

    layer, local = "model.layers.1.mlp", 4
    g, fmt = _grouped_experts_of_rank(twins[0], layer, ep_rank=1, local=local)
    bf16 = {a: getattr(g, a).detach().clone() for a in ("w1", "w2", "w3")}
    with open_shards(str(twins[0])) as shards:
        held = requantize_experts(
            SimpleNamespace(experts=g, num_local_experts=local), layer, ep_rank=1, shards=shards, fmt=fmt
        )
        raw = shards[f"{layer}.experts.5.down_proj.weight"].get_tensor(f"{layer}.experts.5.down_proj.weight")
    assert torch.equal(g.parametrizations.w2.original[1].view(torch.uint8), raw.view(torch.uint8))
    assert held == sum(bf16[a].numel() for a in bf16) + 4 * sum(
        p[0].scale_inv.numel() for p in g.parametrizations.values()
    )
    for a, want in bf16.items():
        assert parametrize.is_parametrized(g, a) and torch.equal(getattr(g, a), want)
        assert getattr(g.parametrizations, a).original.dtype == torch.float8_e4m3fn
    assert not [p for p in g.parameters() if p.dtype != torch.float8_e4m3fn]  # no bf16 copy left
    # the second parametrization goes after ours; gradients reach it through the dequantised weight
    e, n, k = bf16["w1"].shape
    parametrize.register_parametrization(g, "w1", _Lora(e, n, k))
    assert [type(p).__name__ for p in g.parametrizations.w1] == [DequantizedBlocks.__name__, "_Lora"]
    lo = g.parametrizations.w1[1]
    assert torch.equal(g.w1, bf16["w1"] + 0.5 * lo.B @ lo.A)
    x = torch.randn(6, k, dtype=torch.bfloat16)
    out = g(x, torch.tensor([2, 1, 0, 3]))
    out.float().sum().backward()
    assert lo.A.grad is not None and lo.A.grad.abs().sum() > 0


def _fp8_and_bf16_experts(fp8: Path, local: int = 4):
    from dskit.train.fp8.frozen_base import requantize_experts
    from dskit.train.fp8.loading import open_shards

    layer = "model.layers.1.mlp"
    g, fmt = _grouped_experts_of_rank(fp8, layer, ep_rank=1, local=local)
    ref, _ = _grouped_experts_of_rank(fp8, layer, ep_rank=1, local=local)
    with open_shards(str(fp8)) as shards:
        requantize_experts(
            SimpleNamespace(experts=g, num_local_experts=local), layer, ep_rank=1, shards=shards, fmt=fmt
        )
    return g, ref


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_backward_keeps_the_experts_fp8_bytes_not_their_dequantised_weights(twins, checkpointed):
    """Autograd saves no view of a dequantised expert weight (the largest saved tensor is an activation),
    and the input gradient is the bf16 experts' own, also under torch's non-reentrant checkpointing
    (whose saved-tensor hooks the experts' pair hands the activations to)."""
    from torch.utils.checkpoint import checkpoint

    g, ref = _fp8_and_bf16_experts(twins[0])
    counts = torch.tensor([2, 1, 0, 3])
    x = torch.randn(6, ref.w1.shape[2], dtype=torch.bfloat16)
    grads, saved = [], []
    for m in (g, ref):
        xi = x.clone().requires_grad_()
        record = (lambda t: (saved.append(t.untyped_storage().nbytes()), t)[1]) if m is g else (lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
            y = checkpoint(m, xi, counts, use_reentrant=False) if checkpointed else m(xi, counts)
        y.float().square().sum().backward()
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1])
    if not checkpointed:  # checkpointing saves only its inputs; without it, the activations alone
        assert saved and max(saved) < ref.w1.numel() * 2, saved


def test_expert_bytes_from_another_rank_are_refused(twins):
    """The slicing check: rank 1's bf16 experts and rank 0's FP8 bytes do not agree, loudly."""
    from dskit.train.fp8.frozen_base import requantize_experts
    from dskit.train.fp8.loading import open_shards

    layer, local = "model.layers.1.mlp", 4
    g, fmt = _grouped_experts_of_rank(twins[0], layer, ep_rank=1, local=local)
    with open_shards(str(twins[0])) as shards, pytest.raises(RuntimeError, match="do not dequantise"):
        requantize_experts(
            SimpleNamespace(experts=g, num_local_experts=local), layer, ep_rank=0, shards=shards, fmt=fmt
        )


# ---------------------------------------------------------------------------------------------------
# broken inputs: one line, exit 2, nothing written


LORA_FP8 = ["--set", "finetune.method=lora", "--set", "training.seq_len=128"]


@pytest.mark.parametrize("case", ["block size", "missing scale"])
def test_a_broken_fp8_checkpoint_under_lora_is_one_line_exit_2_and_nothing_written(tmp_path, case):
    kwargs, want = BROKEN[case]
    d = _small_fp8_dir(tmp_path / "ckpt", **kwargs)
    out = tmp_path / "out"
    r = dskit("render", "slurm", "--gpu", "cpu", "--set", f"model.path={d}", *LORA_FP8, "-o", str(out))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("dskit: error: model.path: ") and want.format(d=d, W=W) in r.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("twin", "sets", "want"),
    [
        (1, ["finetune.base_precision=fp8"], "finetune.base_precision: fp8 keeps model.path's FP8 weights"),
        (
            0,
            ["finetune.base_precision=fp8", "overrides.zero_stage=3"],
            "overrides.zero_stage: 3 cannot hold an fp8 frozen base",
        ),
    ],
)
def test_an_fp8_base_the_trainer_cannot_hold_is_one_line_exit_2_and_nothing_written(
    tmp_path, twins, twin, sets, want
):
    """fp8 asked of the bf16 twin (nothing to keep in FP8), or under ZeRO-3 on the FP8 one. (With
    base_precision auto, ZeRO-3 on the FP8 one plans a bf16 base instead: tests/plan/test_lora_plan.py.)"""
    ckpt = twins[twin]
    out = tmp_path / "out"
    extra = [x for s in sets for x in ("--set", s)]
    r = dskit(
        "render", "slurm", "--gpu", "cpu", "--set", f"model.path={ckpt}", *LORA_FP8, *extra, "-o", str(out)
    )
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith(f"dskit: error: {want}"), r.stderr
    assert not out.exists()


def test_the_trainer_refuses_an_fp8_base_under_zero3_in_one_line(tmp_path, twins):
    """The plan never picks it; a run.yaml edited to ZeRO-3 afterwards stops at start, before any rank
    builds anything (checked before the process group forms)."""
    import yaml

    from tests.train.test_train import rank0_alone

    rd = _render(tmp_path, twins[0])
    f = Path(rd) / "run.yaml"
    plan = yaml.safe_load(f.read_text())
    plan["deepspeed"]["zero_optimization"]["stage"] = 3
    f.write_text(yaml.safe_dump(plan))
    r = rank0_alone(f)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "dskit: error: overrides.zero_stage: 3 cannot hold an fp8 frozen base" in r.stderr, r.stderr
    assert not Path(load_plan(f).run.output_dir).exists()


def test_the_trainer_refuses_a_model_path_holding_only_the_fp8_config(tmp_path, twins):
    """A config.json with V3's quantization_config plans an fp8 base (sizing, before the weights are
    at hand); the trainer needs the weights and says so at start, in one line naming model.path."""
    from tests.train.test_train import rank0_alone

    cfg_only = tmp_path / "config-only"
    cfg_only.mkdir()
    shutil.copy(twins[0] / "config.json", cfg_only / "config.json")
    rd = _render(tmp_path, cfg_only)
    assert load_plan(rd / "run.yaml").finetune.base_precision == "fp8"
    r = rank0_alone(Path(rd) / "run.yaml")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("dskit: error: finetune.base_precision: fp8 keeps model.path's FP8"), r.stderr
    assert "no weights to read (model.path unset, or a config.json alone)" in r.stderr, r.stderr


@pytest.mark.train
def test_zero1_trains_the_fp8_base_from_the_same_first_loss(tmp_path, twins, runs):
    """The other stage an FP8 base trains under: gradients whole per rank, the same first step."""
    rd = _render(tmp_path, twins[0], extra=("overrides.zero_stage=1",))
    assert load_plan(rd / "run.yaml").deepspeed["zero_optimization"]["stage"] == 1
    assert run(rd, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-4000:]
    got = losses(rd)
    assert got[1] == pytest.approx(losses(runs["fp8"])[1], rel=1e-6) and len(got) == STEPS


@pytest.mark.train
def test_routed_adapters_on_the_fp8_experts_train_as_on_the_bf16_twins(tmp_path, twins):
    """The two parametrizations stacked on each rank's experts, FP8 dequantisation then the LoRA delta
    (dskit/train/lora/routed.py): the same losses at every step as the same run on the bf16 twin."""
    routed = ("finetune.lora.targets=[attention, shared_experts, routed_experts]",)
    got = {}
    for name, ckpt in zip(("fp8", "bf16"), twins, strict=True):
        rd = _render(tmp_path / name, ckpt, extra=routed)
        assert load_plan(rd / "run.yaml").finetune.base_precision == name
        assert run(rd, tmp_path / f"{name}.log") == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
        got[name] = losses(rd)
    assert sorted(got["fp8"]) == list(range(1, STEPS + 1))
    assert got["fp8"] == pytest.approx(got["bf16"], rel=1e-5)
    assert got["fp8"][STEPS] != pytest.approx(got["fp8"][1], rel=1e-3)


@pytest.mark.train
def test_zero3_partitions_a_float8_parameter_but_cannot_gather_it_on_gloo():
    """Why an fp8 base is refused under ZeRO-3 (besides Fp8Linear's buffers, which it never partitions):
    DeepSpeed 0.19.8 partitions a frozen float8 parameter (half of it per rank) but its all-gather
    fails on gloo ("Invalid scalar type": no float8 collectives). If this starts passing the gather,
    ZeRO-3 for an FP8 base is worth trying again."""
    import subprocess
    import sys

    probe = Path(__file__).parents[1] / "support" / "zero3_float8_probe.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(probe)]
    r = subprocess.run(torchrun, capture_output=True, text=True, timeout=600)
    # the two ranks share one stdout pipe, so a line of one can land inside the other's: read the
    # reports themselves, not lines (seen in CI: "...Invalid scalar typerank 1 gather failed: ...")
    report = r"rank \d (?:partition \S+ \d+|gather failed: Invalid scalar type)"
    seen = sorted(re.findall(report, r.stdout))
    assert seen == [
        "rank 0 gather failed: Invalid scalar type",
        "rank 0 partition torch.float8_e4m3fn 30000",
        "rank 1 gather failed: Invalid scalar type",
        "rank 1 partition torch.float8_e4m3fn 30000",
    ], r.stdout[-2000:] + r.stderr[-2000:]
