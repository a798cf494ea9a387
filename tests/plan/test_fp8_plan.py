"""training.fp8 in the plan (dskit/plan/fp8_training.py): the user's choice, refused in one line where the GPU cannot
run it, and otherwise a recipe plus the products measured to gain from FP8, written in run.yaml."""

from __future__ import annotations

import pytest

from dskit import catalog
from dskit.errors import SpecError
from dskit.plan import fp8_training as fp8
from dskit.plan.build import build_plan
from dskit.plan.shape import ModelShape
from dskit.spec import load_spec
from tests.support.cli import cli


def _plan(gpu: str, model: str, *sets: str, nodes: int = 1):
    hw = {"hardware.gpu": gpu, "hardware.gpus_per_node": 8, "hardware.nodes": nodes, "model.preset": model}
    return build_plan(load_spec(None, ["training.seq_len=4096", *sets], hw))


def _shape(model: str) -> ModelShape:
    return ModelShape.from_config(catalog.model(model).config)


@pytest.mark.parametrize(
    ("gpu", "why"),
    [
        ("a100-80gb", "a100-80gb has no FP8 tensor cores"),
        ("v100-32gb", "v100-32gb has no FP8 tensor cores"),
        ("cpu", "cpu has no FP8 tensor cores"),
        ("l40s-48gb", "l40s-48gb (compute capability 8.9) has FP8 tensor cores but no FP8 grouped GEMM"),
        (
            "rtx4090-24gb",
            "rtx4090-24gb (compute capability 8.9) has FP8 tensor cores but no FP8 grouped GEMM",
        ),
    ],
)
def test_a_gpu_that_cannot_run_fp8_is_refused_naming_it(gpu, why):
    with pytest.raises(SpecError) as e:
        _plan(gpu, "deepseek-v2-lite", "training.fp8=on", "training.global_batch=64")
    assert e.value.field == "training.fp8"
    assert why in e.value.message and "one of: off" in e.value.message


def test_the_refusal_is_one_line_exit_2_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    r = cli("render", "slurm", "--gpu", "a100-80gb", "--model", "deepseek-v2-lite", "-o", str(out),
            "--set", "training.fp8=rowwise")  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "dskit: error: training.fp8: a100-80gb has no FP8 tensor cores; one of: off (FP8 needs Hopper or "
        "newer: h100, h200)"
    ]
    assert not out.exists()


def test_fp8_runs_over_bf16_weights_only():
    with pytest.raises(SpecError, match="runs over bf16 weights; this plan's precision is fp16"):
        _plan("h100-80gb", "deepseek-v2-lite", "training.fp8=on", "overrides.precision=fp16")


@pytest.mark.parametrize(
    ("asked", "recipe"), [("on", "tensorwise"), ("rowwise", "rowwise"), ("tensorwise", "tensorwise")]
)
def test_the_recipe_is_the_one_asked_and_on_is_the_fastest(asked, recipe):
    p = _plan("h200-141gb", "deepseek-v2-lite", f"training.fp8={asked}").parallel
    assert p.fp8 == recipe


def test_off_is_bf16_everywhere():
    p = _plan("h200-141gb", "deepseek-v2-lite").parallel
    assert (p.fp8, p.fp8_linears, p.fp8_experts) == (None, [], False)


def test_v3_puts_its_large_linears_in_fp8_and_keeps_mlas_small_projections_bf16():
    roles = fp8.linear_roles(_shape("deepseek-v3"), "tensorwise")
    # measured faster in FP8 (tensorwise, compiled, H100, against the eager bf16 linear): 1.10-1.58x
    assert roles == [
        "self_attn.q_b_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    # rowwise pays on fewer: q_b_proj ran 0.89x
    assert "self_attn.q_b_proj" not in fp8.linear_roles(_shape("deepseek-v3"), "rowwise")


def test_v2_lite_has_no_linear_large_enough():
    assert fp8.linear_roles(_shape("deepseek-v2-lite"), "tensorwise") == []
    plan = _plan("h100-80gb", "deepseek-v2-lite", "training.fp8=on")
    assert any("training.fp8: no linear of this model" in w for w in plan.warnings)


def test_a_model_too_small_to_gain_says_it_computes_in_bf16():
    plan = _plan(
        "h100-80gb", "tiny-v2", "training.fp8=on", "training.seq_len=512", "training.global_batch=64"
    )
    assert plan.parallel.fp8_linears == [] and not plan.parallel.fp8_experts
    assert any(
        "training.fp8: no linear of this model" in w and "computes in bf16" in w for w in plan.warnings
    )


def test_the_plan_predicts_fp8_at_its_measured_speed_up_and_explain_shows_both():
    """FP8 takes off the converted products' bf16 time less their FP8 time, once: the prediction moves by
    exactly that share of the step's compute, and --explain shows each choice beside the other."""
    sets = ("training.global_batch=2048", "overrides.zero_stage=3", "overrides.ep_size=8")
    bf16 = _plan("h100-80gb", "deepseek-v3", *sets, nodes=32)
    on = _plan("h100-80gb", "deepseek-v3", "training.fp8=on", *sets, nodes=32)
    assert on.parallel.fp8_linears and on.speed["tokens_per_s_per_gpu"] > bf16.speed["tokens_per_s_per_gpu"]
    r = cli("plan", "--explain", "--gpu", "h100-80gb", "--model", "deepseek-v3", "--nodes", "32", *[
        x for kv in sets for x in ("--set", kv)])  # fmt: skip
    line = next(x for x in r.stdout.splitlines() if x.startswith("precision: bf16: "))
    assert "training.fp8=on (tensorwise on self_attn.q_b_proj" in line and "changes the numerics" in line
    assert f"{on.speed['tokens_per_s_per_gpu']:,}" in line


def test_no_precision_line_where_the_gpu_has_no_fp8():
    r = cli("plan", "--explain", "--gpu", "a100-80gb", "--model", "deepseek-v2-lite")
    assert r.returncode == 0 and "precision:" not in r.stdout


def test_the_experts_stay_bf16_unless_pinned():
    assert not _plan("h100-80gb", "deepseek-v2-lite", "training.fp8=on").parallel.fp8_experts
    pinned = _plan("h100-80gb", "deepseek-v2-lite", "training.fp8=on", "overrides.fp8_experts=on").parallel
    assert pinned.fp8_experts


@pytest.mark.parametrize("preset", ["tiny-v2", "tiny-v3", "tiny-v2-experts"])
def test_every_role_and_its_sides_are_the_models_own(preset):
    """The plan names linears by role without building the model: each role and its (in, out) must be
    what transformers builds, or the trainer would convert nothing (or the wrong linear)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dskit.train.fp8.compute import role
    from dskit.train.model import hf_config

    cfg = catalog.model(preset).config
    model = AutoModelForCausalLM.from_config(hf_config(dict(cfg), "sdpa"))
    built = {
        role(n): (m.in_features, m.out_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }
    assert fp8.linear_sides(_shape(preset)) == built


def test_a_lora_run_is_refused():
    with pytest.raises(SpecError) as e:
        _plan("h100-80gb", "deepseek-v2-lite", "training.fp8=on", "finetune.method=lora")
    assert e.value.field == "training.fp8" and "one of: off" in e.value.message


def test_fp8_experts_without_fp8_says_it_does_nothing():
    plan = _plan("h100-80gb", "deepseek-v2-lite", "overrides.fp8_experts=on")
    assert any("overrides.fp8_experts=on does nothing without training.fp8" in w for w in plan.warnings)
