"""LoRA in the spec and the plan: what trains, what is frozen, what fits; bad values refused.

The trainer's side (real DeepSpeed + AutoEP runs on gloo) is tests/train/test_lora.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dskit import catalog
from dskit.plan import adapters
from dskit.plan.build import build_plan
from dskit.plan.model_math import counts
from dskit.plan.shape import ModelShape
from dskit.spec import load_spec
from tests.conftest import dskit, render_tiny


def _plan(model: str, gpu: str, per_node: int, *sets: str):
    return build_plan(
        load_spec(
            sets=list(sets),
            flags={"model.preset": model, "hardware.gpu": gpu, "hardware.gpus_per_node": per_node},
        )
    )


def test_full_depth_v2_lite_with_lora_fits_one_h200_where_full_training_does_not():
    with pytest.raises(Exception, match="host"):
        _plan("deepseek-v2-lite", "h200-141gb", 1)
    p = _plan("deepseek-v2-lite", "h200-141gb", 1, "finetune.method=lora")
    assert p.model.config["num_hidden_layers"] == 27
    assert p.memory["total_gib"] <= p.memory["limit_gib"]
    f = p.finetune
    assert f is not None and f.targets == ["attention", "shared_experts"] and f.whole_params is None
    # a few tenths of a percent of the model trains: what the checkpoints and optimizer hold
    assert f.trainable_params == f.adapter_params and f.trainable_params < 0.002 * p.model.params_total


def test_v3_lora_on_its_fp8_base_fits_one_h200_node_where_a_bf16_base_does_not():
    """The goal of LoRA on an FP8 base: DeepSeek-V3, FP8 base + LoRA, on 1 x 8 H200 fits, with a predicted speed. The
    trainer builds the base from the meta device (dskit/train/fp8/construct.py), so construction holds only
    the rank's FP8 share: the non-expert base whole and 1/8 of the experts, below the steady state."""
    p = _plan("deepseek-v3", "h200-141gb", 8, "finetune.method=lora", "finetune.base_precision=fp8")
    assert p.deepspeed["zero_optimization"]["stage"] in (1, 2) and p.parallel.ep_size == 8
    m = p.memory
    assert max(m["total_gib"], m["construction_gib"]) <= m["limit_gib"]
    assert m["construction_gib"] < m["total_gib"] and p.speed["tokens_per_s_per_gpu"] > 0
    c = counts(ModelShape.from_config(p.model.config), p.parallel.seq_len)
    share = c.total - c.experts_per_layer * c.moe_layers * (1 - 1 / 8)
    assert 0.95 * share < m["construction"]["shard_gib"] * 2**30 < 1.1 * share  # ~1 byte per weight held
    with pytest.raises(Exception, match="hardware.nodes|cannot be built"):
        _plan("deepseek-v3", "h200-141gb", 8, "finetune.method=lora")  # 2 B/weight: 1.3 TB on 1.1 TB


def test_an_fp8_base_that_fits_no_gpu_names_base_precision_and_the_nodes_that_fit():
    """ZeRO-1/2 keep the non-expert base whole on every GPU: only a larger EP (more nodes) shrinks it."""
    with pytest.raises(Exception) as e:
        _plan("deepseek-v3", "h100-80gb", 8, "finetune.method=lora", "finetune.base_precision=fp8")
    msg = str(e.value)
    assert msg.startswith("finetune.base_precision: ") and "cannot hold an fp8 base" in msg
    assert "at least 4 nodes of 8 (hardware.nodes)" in msg and "finetune.base_precision=bf16" in msg
    four = build_plan(
        load_spec(
            sets=["finetune.method=lora", "finetune.base_precision=fp8"],
            flags={"model.preset": "deepseek-v3", "hardware.gpu": "h100-80gb", "hardware.nodes": 4},
        )
    )
    assert four.parallel.ep_size == 32  # the hint's node count fits, at EP across nodes


def test_auto_takes_a_bf16_base_where_v3s_own_fp8_checkpoint_cannot_be_planned_in_fp8(tmp_path):
    """V3 ships in FP8, so `base_precision: auto` reads fp8 from its checkpoint; where no fp8 plan can
    exist (ZeRO-3 pinned: it holds a bf16 base, not yet an fp8 one) auto plans bf16 and says why in a
    warning, while an explicit fp8 keeps its one-line refusal."""
    cfg = dict(catalog.model("deepseek-v3").config)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def plan(*sets: str):
        return build_plan(
            load_spec(
                sets=["finetune.method=lora", *sets],
                flags={"model.path": str(tmp_path), "hardware.gpu": "h200-141gb", "hardware.nodes": 2},
            )
        )

    p = plan()
    assert p.finetune.base_precision == "fp8" and p.deepspeed["zero_optimization"]["stage"] in (1, 2)
    z3 = plan("overrides.zero_stage=3")
    assert z3.finetune.base_precision == "bf16" and z3.deepspeed["zero_optimization"]["stage"] == 3
    assert z3.warnings[0].startswith("finetune.base_precision auto planned a bf16 base")
    assert "3 cannot hold an fp8 frozen base" in z3.warnings[0]
    with pytest.raises(Exception, match="overrides.zero_stage: 3 cannot hold an fp8 frozen base"):
        plan("finetune.base_precision=fp8", "overrides.zero_stage=3")


def test_an_fp8_base_plans_zero_1_or_2_counting_what_each_rank_holds():
    """ZeRO-1/2: every rank holds the non-expert FP8 base whole and 1/ep of the FP8 experts (what the
    trainer's construction-rankN.json `frozen_bytes` shows), from construction on."""
    sets = ("finetune.method=lora", "finetune.base_precision=fp8")
    p = _plan("deepseek-v2-lite", "h200-141gb", 8, *sets)
    bf16 = _plan("deepseek-v2-lite", "h200-141gb", 8, "finetune.method=lora", "overrides.zero_stage=2")
    assert p.deepspeed["zero_optimization"]["stage"] in (1, 2) and p.finetune.base_precision == "fp8"
    assert p.memory["states_gib"] < 0.6 * bf16.memory["states_gib"]
    assert p.memory["construction_gib"] < 0.6 * bf16.memory["construction_gib"]
    assert p.memory["construction"]["autoep_copy_gib"] == 0  # AutoEP copies meta experts
    assert not [w for w in p.warnings if "sizing" in w and "preset" not in w]
    with pytest.raises(Exception, match="overrides.zero_stage: 3 cannot hold an fp8 frozen base"):
        _plan("deepseek-v2-lite", "h200-141gb", 8, *sets, "overrides.zero_stage=3")


def test_frozen_weights_carry_no_gradients_or_optimizer_states():
    """ZeRO-3 states per GPU: 2 B per frozen weight and 16 B per trainable one, over the world."""
    p = _plan("deepseek-v2-lite", "h200-141gb", 8, "finetune.method=lora", "overrides.zero_stage=3")
    full = _plan("deepseek-v2-lite", "h200-141gb", 8, "overrides.zero_stage=3")
    f, world = p.finetune, 8
    want = (2 * f.frozen_params + 16 * f.trainable_params) / world / 2**30
    assert p.memory["states_gib"] == pytest.approx(want, abs=0.01)
    assert full.memory["states_gib"] == pytest.approx(16 * full.model.params_total / world / 2**30, abs=0.01)
    # the step: no weight-gradient GEMMs for the frozen base (4 of full training's 6 FLOPs per weight)
    assert p.model.flops_per_token < 0.75 * full.model.flops_per_token


def test_fp8_counts_one_byte_and_its_block_scales_per_frozen_linear_weight():
    shape = ModelShape.from_config(catalog.model("deepseek-v3").config)
    c = counts(shape, 4096)
    kw = {"targets": ["attention"], "r": 16, "dropout": 0.0}
    bf16 = adapters.tuning(shape, c, base_precision="bf16", **kw)
    fp8 = adapters.tuning(shape, c, base_precision="fp8", **kw)
    assert bf16.expert_bytes == 2 and fp8.expert_bytes == 1 + 4 / 128**2
    # the embedding, lm_head and norms stay bf16, so the non-expert average sits between 1 and 2
    assert 1 < fp8.other_bytes < 1.25 and bf16.other_bytes == 2
    assert fp8.dequant_bytes > 0 == bf16.dequant_bytes


@pytest.mark.parametrize("model", ["tiny-v2", "tiny-v3"])
def test_the_plans_adapter_count_is_what_peft_injects(model):
    """The same regex the trainer hands peft, on the real transformers model."""
    import torch
    from transformers import AutoModelForCausalLM

    from dskit.train.lora.inject import attach
    from dskit.train.model import hf_config

    sets = [
        "training.seq_len=128",
        "finetune.method=lora",
        "finetune.lora.targets=[attention, shared_experts, dense_mlp, router]",
    ]
    p = build_plan(load_spec(sets=sets, flags={"model.preset": model, "hardware.gpu": "cpu"}))
    m = AutoModelForCausalLM.from_config(hf_config(p.model.config, "sdpa"))
    attach(m, p.finetune, seed=1, dtype=torch.bfloat16)  # raises if the counts differ
    trained = {n for n, q in m.named_parameters() if q.requires_grad}
    assert any(".mlp.shared_experts.gate_proj.lora_A" in n for n in trained)
    assert any(".layers.0.mlp.gate_proj.lora_A" in n for n in trained)  # the dense layer
    assert not any(".experts." in n and "shared" not in n for n in trained)  # routed: frozen
    router = sum(q.numel() for n, q in m.named_parameters() if n.endswith("mlp.gate.weight"))
    assert sum(q.numel() for n, q in m.named_parameters() if q.requires_grad) == p.finetune.trainable_params
    assert p.finetune.trainable_params == p.finetune.adapter_params + router


def test_explain_shows_the_lora_terms():
    r = dskit(
        "plan", "--model", "deepseek-v2-lite", "--gpu", "h200-141gb", "--gpus-per-node", "1",
        "--set", "finetune.method=lora", "--explain",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "LoRA r 16, alpha 32" in r.stdout and "frozen F = " in r.stdout
    assert "no weight-gradient GEMMs for frozen weights" in r.stdout


def test_a_full_run_records_no_finetune_section(tmp_path):
    """Existing specs render what they rendered before LoRA (the goldens check every byte)."""
    rd = render_tiny(tmp_path, "tiny-v2")
    data = yaml.safe_load((rd / "run.yaml").read_text())
    assert "finetune" not in data and "finetune" not in data["spec"]
    rd2 = render_tiny(tmp_path, "tiny-v2", name="lora", extra=["finetune.method=lora"])
    data = yaml.safe_load((rd2 / "run.yaml").read_text())
    assert data["finetune"]["method"] == "lora" and data["spec"]["finetune"]["lora"]["r"] == 16


BAD = {
    "finetune.method=qlora": "finetune.method: Input should be 'full' or 'lora'",
    "finetune.lora.r=0": "finetune.lora.r: Input should be greater than or equal to 1",
    "finetune.lora.targets=[attention, mlp]": "finetune.lora.targets: 'mlp' is not a target; one of: attention, "
    "shared_experts, dense_mlp, router, routed_experts",
    "finetune.lora.dropout=1": "finetune.lora.dropout: Input should be less than 1",
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_lora_values_are_one_line_and_exit_2(tmp_path, bad):
    r = dskit("render", "slurm", "-o", str(tmp_path / "out"), "--set", "finetune.method=lora", "--set", bad)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith(f"dskit: error: {BAD[bad]}"), r.stderr
    assert not (tmp_path / "out").exists()


def test_dropout_on_the_routed_experts_is_one_line_and_exit_2(tmp_path):
    """A weight delta sees no input to drop (dskit/train/lora/routed.py): refused before anything is written."""
    sets = [
        "finetune.method=lora",
        "finetune.lora.dropout=0.1",
        "finetune.lora.targets=[attention, routed_experts]",
    ]
    r = dskit("render", "slurm", "-o", str(tmp_path / "out"), *(a for s in sets for a in ("--set", s)))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("dskit: error: finetune.lora: dropout 0.1 cannot apply to routed_experts"), (
        r.stderr
    )
    assert not (tmp_path / "out").exists()


def test_routed_adapters_are_counted_per_expert_and_sharded_by_ep():
    """r (in + out) per expert and projection, every expert of every MoE layer; a rank holds 1/ep under
    ZeRO-1/2, and the routed weight-gradient GEMMs are in the step's FLOPs."""
    cfg = catalog.model("deepseek-v2-lite").config
    shape = ModelShape.from_config(cfg)
    c = counts(shape, 4096)
    kw = {"r": 16, "dropout": 0.0, "base_precision": "bf16"}
    base = adapters.tuning(shape, c, targets=["attention"], **kw)
    routed = adapters.tuning(shape, c, targets=["attention", "routed_experts"], **kw)
    h, inter, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    want = c.moe_layers * E * 16 * 3 * (h + inter)
    assert routed.routed_adapters == want and routed.adapters == base.adapters + want
    assert routed.trainable_local(8) == pytest.approx(base.trainable + want / 8)
    active = c.moe_layers * cfg["num_experts_per_tok"] * 3 * h * inter
    assert routed.flops_per_token(c) - base.flops_per_token(c) == pytest.approx(2 * active)
    p = _plan(
        "deepseek-v2-lite", "h200-141gb", 8, "finetune.method=lora", "finetune.lora.targets=[routed_experts]"
    )
    assert p.finetune.routed_adapter_params == p.finetune.adapter_params == want
    assert p.finetune.target_modules is None  # nothing for peft: the trainer attaches them after AutoEP
    r = dskit(
        "plan", "--model", "deepseek-v2-lite", "--gpu", "h200-141gb", "--gpus-per-node", "1",
        "--set", "finetune.method=lora", "--set", "finetune.lora.targets=[routed_experts]", "--explain",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "routed experts: 0.276 B adapters" in r.stdout and "routed weight-gradient GEMMs" in r.stdout


def test_fp8_base_needs_lora(tmp_path):
    r = dskit("plan", "--set", "finetune.base_precision=fp8")
    assert r.returncode == 2 and "needs finetune.method lora" in r.stderr and r.stderr.count("\n") == 1


def test_targets_that_match_nothing_are_refused(tmp_path):
    """dense_mlp alone on a model whose every layer is MoE adapts nothing: refused at plan time."""
    cfg = dict(catalog.model("tiny-v2").config, first_k_dense_replace=0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = dskit(
        "render", "slurm", "-o", str(tmp_path / "out"), "--set", f"model.path={tmp_path}",
        "--set", "training.seq_len=128", "--set", "finetune.method=lora", "--set", "finetune.lora.targets=[dense_mlp]",
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("dskit: error: finetune.lora.targets: dense_mlp match no module"), r.stderr
    assert not (tmp_path / "out").exists()


def test_the_trainer_refuses_an_fp8_base_without_an_fp8_checkpoint_in_one_line(tmp_path):
    """A catalog preset plans fp8 for sizing (a warning says so); the trainer needs model.path's FP8 bytes."""
    from tests.train.test_train import rank0_alone

    rd = render_tiny(tmp_path, "tiny-v2", extra=["finetune.method=lora", "finetune.base_precision=fp8"])
    r = rank0_alone(Path(rd) / "run.yaml")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "finetune.base_precision: fp8 keeps model.path's FP8 weights" in r.stderr
    assert "the run has no weights to read (model.path unset, or a config.json alone)" in r.stderr


def test_adapter_only_export_of_a_full_run_is_one_line_and_exit_2(tmp_path):
    rd = render_tiny(tmp_path, "tiny-v2")
    r = dskit("export", str(rd), "-o", str(tmp_path / "out"), "--adapter-only")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--adapter-only: run is a full fine-tune" in r.stderr and not (tmp_path / "out").exists()


def test_a_lora_run_refuses_a_full_runs_checkpoint_and_back():
    """The files differ in kind (DeepSpeed's vs dskit's adapter states): one line naming the method.
    Checkpoints from before the method was recorded are full runs'."""
    from types import SimpleNamespace

    from dskit.errors import SpecError
    from dskit.train.checkpoints.store import Checkpointer

    lora_run = SimpleNamespace(layout={"zero_stage": 3, "ep_size": 2, "finetune": "lora"})
    full_run = SimpleNamespace(layout={"zero_stage": 3, "ep_size": 2})
    full_ckpt = {"layout": {"zero_stage": 3, "ep_size": 2}}
    lora_ckpt = {"layout": {"zero_stage": 3, "ep_size": 2, "finetune": "lora"}}
    with pytest.raises(SpecError, match="written with finetune full, this run has lora"):
        Checkpointer._refuse_other_layout(lora_run, Path("c"), full_ckpt)
    with pytest.raises(SpecError, match="finetune.method=lora"):
        Checkpointer._refuse_other_layout(full_run, Path("c"), lora_ckpt)
    Checkpointer._refuse_other_layout(lora_run, Path("c"), lora_ckpt)
    Checkpointer._refuse_other_layout(full_run, Path("c"), full_ckpt)


def test_a_lora_run_refuses_a_checkpoint_of_another_rank_or_target_set():
    """The adapters' shapes and names are in the files: resuming with another finetune.lora.r or
    finetune.lora.targets is one line naming the field and the value the checkpoint needs."""
    from types import SimpleNamespace

    from dskit.errors import SpecError
    from dskit.train.checkpoints.store import Checkpointer
    from dskit.train.loop import _layout

    def layout(*sets: str) -> dict:
        return _layout(
            _plan("deepseek-v2-lite", "h200-141gb", 8, "finetune.method=lora", "overrides.ep_size=8", *sets)
        )

    ckpt = {"layout": layout()}
    routed = SimpleNamespace(
        layout=layout("finetune.lora.targets=[attention, shared_experts, routed_experts]")
    )
    with pytest.raises(
        SpecError, match=r"finetune.lora.targets: .* set finetune.lora.targets=\[attention, shared_experts\]"
    ):
        Checkpointer._refuse_other_layout(routed, Path("c"), ckpt)
    with pytest.raises(SpecError, match="finetune.lora.r: .*written with lora r 16, this run has 8"):
        Checkpointer._refuse_other_layout(
            SimpleNamespace(layout=layout("finetune.lora.r=8")), Path("c"), ckpt
        )
    Checkpointer._refuse_other_layout(SimpleNamespace(layout=layout()), Path("c"), ckpt)
    older = {"layout": {k: v for k, v in ckpt["layout"].items() if not k.startswith("lora_")}}
    Checkpointer._refuse_other_layout(routed, Path("c"), older)  # written before the adapters were recorded


def test_a_lora_step_copies_only_the_trainable_gradients():
    """ZeRO-2's per-micro-step gradient copies are over what trains: the adapters (routed ones too,
    1/ep of them per rank), not the frozen base."""
    from dskit.plan import speed
    from dskit.plan.candidate import Candidate, Cluster, Workload
    from dskit.plan.links import Links

    shape = ModelShape.from_config(dict(catalog.model("deepseek-v2-lite").config, num_hidden_layers=4))
    c = counts(shape, 4096)
    t = adapters.tuning(
        shape,
        c,
        targets=["attention", "shared_experts", "routed_experts"],
        r=16,
        dropout=0.0,
        base_precision="bf16",
    )
    gpu = catalog.gpu("h200-141gb")
    step = speed.predict(
        Workload(shape, c, t.flops_per_token(c), seq_len=4096, per_rank=2 * 3, tuning=t),
        Candidate(ep_size=4, micro_batch=2, ckpt_every=0, offload=False, zero_stage=2),
        Cluster(gpu, world=8, per_node=8, peak_tflops=989),
        Links(gpu.interconnect_gbs, None),
    )
    dense, routed = t.trainable - t.routed_adapters, t.routed_adapters / 4
    want = (dense + routed) * speed.ZERO12_BUCKET_BYTES_PER_PARAM + (dense / 8 + routed / 2) * (
        speed.ZERO12_PARTITION_BYTES_PER_PARAM
    )
    assert t.routed_adapters > 0 and t.trainable < 0.05 * c.total
    assert step.grad_copy_s == pytest.approx(3 * want / (gpu.memory_bw_gbs * speed.GB))
