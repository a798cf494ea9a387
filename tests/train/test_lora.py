"""LoRA on the real trainer: DeepSpeed + AutoEP (EP 2) on 2 gloo ranks, tiny V2 under ZeRO-3
and tiny V3 under ZeRO-2, both from a saved Hugging Face checkpoint (model.path), as a user starts; each
also with the routed experts adapted (an adapter per expert on AutoEP's grouped experts, each rank
holding its half; peft's reference is `target_parameters` on transformers' fused experts).

V3 adapts everything dskit can (attention, shared experts, the dense layer's MLP) with dropout, and
trains the router whole. Checked against plain transformers + peft: the first loss, the exported
adapter loaded by `PeftModel.from_pretrained`, the merged export loaded by transformers; resume from a
checkpoint continues the uninterrupted run; the checkpoint holds the trainable parameters only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dskit.plan.schema import load_plan
from tests.conftest import dskit, render_tiny
from tests.support.hf_reference import first_step_loss
from tests.train.test_train import RESUME_RTOL, losses, run
from tests.train.test_weights import LOSS_RTOL, saved

pytestmark = pytest.mark.train
STEPS, EVERY = 8, 4
#: case -> (model, its settings)
CASES = {
    "tiny-v2": ("tiny-v2", ["overrides.zero_stage=3"]),
    "tiny-v3": (
        "tiny-v3",
        [
            "overrides.zero_stage=2",
            "finetune.lora.targets=[attention, shared_experts, dense_mlp, router]",
            "finetune.lora.dropout=0.1",
        ],
    ),
    # the routed experts' per-expert adapters, attached after AutoEP (dskit/train/lora/routed.py): EP 2,
    # so each rank holds half of them; ZeRO-3 partitions them, ZeRO-2 keeps them whole
    "tiny-v2-routed": (
        "tiny-v2",
        ["overrides.zero_stage=3", "finetune.lora.targets=[attention, routed_experts]"],
    ),
    "tiny-v3-routed": (
        "tiny-v3",
        ["overrides.zero_stage=2", "finetune.lora.targets=[routed_experts, router]"],
    ),
}
#: exported vs trained logits, relative L2: bf16 GEMMs in other orders (export's own check uses 2e-2)
LOGITS_RTOL = 2e-2
#: routed adapters trained at EP 1 vs EP 2, relative L2 after 8 steps: bf16 expert GEMMs and gradient sums
#: in other orders, amplified by Adam on B's small early gradients (measured up to 2.3e-2 here; a
#: wrong reduction group gives order 1)
EP_RTOL = 5e-2


def _render(tmp: Path, case: str, ckpt: Path) -> Path:
    extra = [f"model.path={ckpt}", "finetune.method=lora", f"checkpoint.every={EVERY}", "checkpoint.keep=10"]
    return render_tiny(tmp, None, steps=STEPS, extra=[*extra, *CASES[case][1]])


class _Bases(dict):
    """model -> its base checkpoint, shared by the cases on that model (and by other modules' tests: it
    is saved once per run, tests/train/test_weights.py `saved`), saved when first asked for."""

    def __init__(self, factory: pytest.TempPathFactory):
        super().__init__()
        self.factory = factory

    def __missing__(self, model: str) -> Path:
        # a base trained 2 steps: far from converged, so 8 LoRA steps move the loss well past batch noise
        self[model] = saved(self.factory, model, train_steps=2)
        return self[model]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> _Bases:
    return _Bases(tmp_path_factory)


class _Runs(dict):
    """case -> (run dir, its base checkpoint): one uninterrupted LoRA run each, trained when a test
    first asks for it (so `-k CASE` trains that case only)."""

    def __init__(self, factory, bases):
        super().__init__()
        self.factory, self.bases = factory, bases

    def __missing__(self, case: str) -> tuple[Path, Path]:
        tmp = self.factory.mktemp(case)
        base = self.bases[CASES[case][0]]
        rd = _render(tmp, case, base)
        assert run(rd, tmp / "train.log") == 0, (tmp / "train.log").read_text()[-4000:]
        self[case] = (rd, base)
        return self[case]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, bases) -> _Runs:
    return _Runs(tmp_path_factory, bases)


def _base(ckpt: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, local_files_only=True).eval()


def _probe(rd: Path) -> dict:
    plan = load_plan(rd / "run.yaml")
    return torch.load(Path(plan.run.checkpoint_dir) / f"step{STEPS:08d}" / "probe.pt", weights_only=False)


def _err(model, probe: dict) -> float:
    with torch.no_grad():
        got = model(input_ids=probe["input_ids"]).logits.float()
    return ((got - probe["logits"]).norm() / probe["logits"].norm()).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_loss_is_transformers_plus_peft(runs, case):
    """Step 1 before any update: the base with peft's adapters injected the trainer's way (B = 0)."""
    from dskit.train.lora.inject import attach

    rd, ckpt = runs[case]
    plan = load_plan(rd / "run.yaml")
    m = _base(ckpt)
    attach(m, plan.finetune, seed=plan.run.seed, dtype=torch.bfloat16)
    if "routed_experts" in plan.finetune.targets:
        _peft_on_the_fused_experts(m, plan.finetune)
    ls = losses(rd)
    assert sorted(ls) == list(range(1, STEPS + 1))
    assert ls[1] == pytest.approx(first_step_loss(m, rd), rel=LOSS_RTOL)


def _peft_on_the_fused_experts(m, f) -> None:
    """peft's own adapters on transformers' fused 3-D experts (`target_parameters`, B = 0), as the
    exported adapter declares them."""
    from peft import LoraConfig, inject_adapter_in_model

    from dskit.train.lora.export_adapter import ROUTED_TARGETS
    from dskit.train.lora.inject import _no_v4_rename

    config = LoraConfig(
        r=f.r,
        lora_alpha=f.alpha,
        target_parameters=list(ROUTED_TARGETS),
        rank_pattern={ROUTED_TARGETS[0]: 2 * f.r},
        alpha_pattern={ROUTED_TARGETS[0]: 2 * f.alpha},
    )
    with _no_v4_rename():
        inject_adapter_in_model(config, m, adapter_name="routed")
    assert sum(".lora_" in n and "experts" in n and "shared" not in n for n, _ in m.named_parameters()) > 0


def _peft_params(plan) -> int:
    """The adapter parameters peft holds for the run: dskit's, and for routed experts the zero blocks of
    gate_up_proj's block-diagonal rank-2r B (dskit/train/lora/export_adapter.py)."""
    f, cfg = plan.finetune, plan.model.config
    if "routed_experts" not in f.targets:
        return f.adapter_params
    moe_layers = cfg["num_hidden_layers"] - (cfg.get("first_k_dense_replace") or 0)
    return f.adapter_params + moe_layers * cfg["n_routed_experts"] * 2 * cfg["moe_intermediate_size"] * f.r


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_holds_only_what_trains(runs, case):
    rd, _ = runs[case]
    plan = load_plan(rd / "run.yaml")
    tag = Path(plan.run.checkpoint_dir) / f"step{STEPS:08d}"
    names = {p.name for p in tag.iterdir()}
    assert {"adapter.safetensors", "zero-rank0.pt", "zero-rank1.pt"} <= names
    assert not [n for n in names if "model_states" in n or "optim_states" in n]  # no DeepSpeed files
    T = plan.finetune.trainable_params
    states = sum((tag / n).stat().st_size for n in ("adapter.safetensors", "zero-rank0.pt", "zero-rank1.pt"))
    # bf16 weights (2 B) + fp32 master, momentum, variance (12 B) per trainable parameter, plus pickling
    # and none of the frozen base: the tiny models' adapters are 13-16% of them, so 256 KiB is less
    # than any frozen layer
    assert 14 * T <= states < 14 * T + 256 * 2**10, (states, T)


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_loads_the_exported_adapter_with_the_trained_logits(runs, case, tmp_path):
    from peft import PeftModel

    rd, ckpt = runs[case]
    out = tmp_path / "adapter"
    r = dskit("export", str(rd), "-o", str(out), "--adapter-only", check=True)
    assert "peft format" in r.stdout
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    probe = _probe(rd)
    base_err = _err(_base(ckpt), probe)
    peft_model = PeftModel.from_pretrained(_base(ckpt), out).eval()
    # every adapter the trainer trained is where peft put it (none dropped, none added on the experts)
    lora_params = sum(q.numel() for n, q in peft_model.named_parameters() if ".lora_" in n)
    assert lora_params == _peft_params(load_plan(rd / "run.yaml"))
    if "routed" in case:  # the routed experts' adapters trained, and peft applies them
        from safetensors.torch import load_file

        saved = load_file(str(out / "adapter_model.safetensors"))
        routed_b = [t for n, t in saved.items() if ".mlp.experts." in n and "lora_B" in n]
        assert routed_b and all(t.abs().sum() > 0 for t in routed_b)
    err = _err(peft_model, probe)
    assert err < LOGITS_RTOL and base_err > 5 * err, (err, base_err)  # the adapters are what moved it


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_merged_export_loads_in_transformers_with_the_trained_logits(runs, case, tmp_path, capsys):
    from dskit.train.export import export

    rd, ckpt = runs[case]
    out = export(str(rd), str(tmp_path / "hf"), shard_bytes=100_000)  # several shards: streamed
    assert "verified: exported logits match the trained model" in capsys.readouterr().out
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert _err(_base(out), _probe(rd)) < LOGITS_RTOL
    # it learned: on the batches of step 1 the merged model does better than the base
    assert first_step_loss(_base(out), rd) < first_step_loss(_base(ckpt), rd) - 0.05


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_from_a_checkpoint_continues_the_uninterrupted_run(runs, case, tmp_path):
    """The same run, started over with only the step-4 checkpoint: steps 5..8 reproduce the
    uninterrupted run's losses (the base is rebuilt from model.path, the adapters and optimizer
    partitions come from dskit's checkpoint)."""
    rd, ckpt = runs[case]
    again = _render(tmp_path, case, ckpt)
    tag = f"step{EVERY:08d}"
    src = Path(load_plan(rd / "run.yaml").run.checkpoint_dir) / tag
    dst = Path(load_plan(again / "run.yaml").run.checkpoint_dir) / tag
    shutil.copytree(src, dst)
    log = tmp_path / "train.log"
    assert run(again, log) == 0, log.read_text()[-4000:]
    assert f"resumed from {dst} (step {EVERY})" in log.read_text()
    got, want = losses(again), losses(rd)
    assert sorted(got) == list(range(EVERY + 1, STEPS + 1))
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=RESUME_RTOL), (s, got[s], want[s])


def test_routed_adapters_do_not_depend_on_the_ep_size(runs, tmp_path):
    """The routed case at EP 1 (each rank holds every expert's adapter, reduced over both ranks) trains
    the adapters the EP-2 run trained (each rank its half, reduced over none): seeded and saved by
    global expert index, gradients reduced over the experts' own data-parallel group. The EP-2
    checkpoint is refused by the EP-1 run in one line (its optimizer partitions are per EP rank)."""
    from safetensors.torch import load_file

    case = (
        "tiny-v3-routed"  # ZeRO-2: the reduction groups come from the parameters' tags (ZeRO-3: partitions)
    )
    rd2, base = runs[case]
    rd1 = render_tiny(
        tmp_path, None, steps=STEPS, extra=[f"model.path={base}", "finetune.method=lora", *CASES[case][1],
                                             "overrides.ep_size=1", f"checkpoint.every={STEPS}"],
    )  # fmt: skip
    assert run(rd1, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-4000:]

    def adapters(rd: Path) -> dict:
        tag = Path(load_plan(rd / "run.yaml").run.checkpoint_dir) / f"step{STEPS:08d}"
        return {
            n: t.float() for n, t in load_file(str(tag / "adapter.safetensors")).items() if ".experts.w" in n
        }

    got, want = adapters(rd1), adapters(rd2)
    assert sorted(got) == sorted(want) and any(".experts.w2.lora_B" in n for n in got)
    for n in want:
        assert got[n].shape == want[n].shape
        err = ((got[n] - want[n]).norm() / want[n].norm()).item()
        assert err < EP_RTOL, (n, err)

    again = render_tiny(
        tmp_path, None, name="again", steps=STEPS + 2,
        extra=[f"model.path={base}", "finetune.method=lora", *CASES[case][1], "overrides.ep_size=1",
               f"storage.checkpoint_dir={load_plan(rd2 / 'run.yaml').run.checkpoint_dir}"],
    )  # fmt: skip
    log = tmp_path / "again.log"
    assert run(again, log) == 2, log.read_text()[-3000:]
    assert (
        "overrides.ep_size: checkpoint" in log.read_text()
        and "written with ep size 2, this run has 1" in log.read_text()
    )


def test_routed_adapters_train_alike_with_every_layer_checkpointed(runs, tmp_path):
    """ZeRO-3 re-gathers the experts, their delta's A and B, in a recomputed layer's forward: the
    checkpointed run's losses are the plain one's."""
    case = "tiny-v2-routed"
    rd, base = runs[case]
    extra = [
        f"model.path={base}",
        "finetune.method=lora",
        *CASES[case][1],
        "overrides.activation_checkpointing=1",
    ]
    again = render_tiny(tmp_path, None, steps=STEPS, extra=extra)
    assert "activation_checkpointing: 1" in (again / "run.yaml").read_text()
    assert run(again, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-4000:]
    got, want = losses(again), losses(rd)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=RESUME_RTOL), (s, got[s], want[s])
