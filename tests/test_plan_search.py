"""The planner weighs every candidate and takes the fastest that fits (dskit/plan/search.py, speed.py)."""

from __future__ import annotations

import json

import pytest

from dskit import catalog
from dskit.plan import build_plan_searched, speed
from dskit.plan.model_math import counts, flops_per_token
from dskit.spec import load_spec
from tests.conftest import dskit

H200_1 = {"hardware.gpu": "h200-141gb", "hardware.gpus_per_node": 1, "model.preset": "deepseek-v2-lite"}
SHAPE = ["model.num_layers=4", "training.seq_len=4096"]


def searched(*sets: str, **flags):
    return build_plan_searched(load_spec(sets=list(sets), flags={**H200_1, **flags}))


def test_the_winner_fits_and_nothing_that_fits_is_predicted_clearly_faster():
    plan, found = searched(*SHAPE, "training.global_batch=16")
    best = found.chosen
    assert best.fits and best.verdict == "chosen"
    for r in found.rows[1:]:
        if r.fits:
            assert r.speed.tokens_per_s <= best.speed.tokens_per_s * 1.03, r.verdict
            assert "slower" in r.verdict or "tie" in r.verdict
        else:
            assert r.verdict.startswith("over ")
    # the plan's sections are the winner's
    c = best.candidate
    assert (plan.parallel.ep_size, plan.parallel.micro_batch, plan.parallel.activation_checkpointing) == (
        c.ep_size,
        c.micro_batch,
        c.ckpt_every,
    )
    assert plan.speed["step_s"] == pytest.approx(best.speed.step_s, abs=1e-3)


def test_every_candidate_is_weighed():
    """EP sizes x micro-batches x checkpointing x offload, on two GPUs: 2 EP x 3 mbs x 2 x 2."""
    _, found = searched(*SHAPE, "training.global_batch=8", **{"hardware.gpus_per_node": 2})
    seen = {
        (r.candidate.ep_size, r.candidate.micro_batch, r.candidate.ckpt_every, r.candidate.offload)
        for r in found.rows
    }
    assert seen == {(e, m, k, o) for e in (1, 2) for m in (1, 2, 4) for k in (0, 1) for o in (False, True)}


def test_recompute_is_chosen_only_when_it_pays():
    """No checkpointing where memory allows a large micro-step; with it, a bigger micro-step that the
    un-checkpointed candidates cannot reach must be predicted faster."""
    roomy, _ = searched(*SHAPE, "training.global_batch=2")
    assert roomy.parallel.activation_checkpointing == 0
    deep, found = searched("model.num_layers=12", "training.seq_len=4096", "training.global_batch=4")
    assert deep.parallel.activation_checkpointing == 1  # measured fastest on H200 (docs/planner.md)
    plain = [r for r in found.rows if r.fits and not r.candidate.ckpt_every and not r.candidate.offload]
    assert all(r.candidate.micro_batch < deep.parallel.micro_batch for r in plain)


def test_small_micro_steps_are_host_bound_large_ones_gpu_bound():
    cfg = dict(catalog.model("deepseek-v2-lite").config, num_hidden_layers=4)
    c = counts(cfg, 4096)

    def at(mb: int) -> speed.StepTime:
        return speed.predict(
            cfg,
            c,
            flops_per_token(c),
            gpu=catalog.gpu("h200-141gb"),
            peak_tflops=989,
            fabric_gbs=None,
            layout=speed.Layout(world=1, per_node=1, ep_size=1),
            micro_batch=mb,
            grad_accum=1,
            seq_len=4096,
            ckpt_every=0,
            offload=False,
        )

    assert at(1).bound == "host" and at(16).bound == "GPU"
    assert at(16).tokens_per_s > 1.5 * at(1).tokens_per_s


def test_unknown_fabric_bandwidth_is_named_not_guessed():
    plan, found = searched(
        "training.global_batch=32",
        **{
            "hardware.nodes": 2,
            "hardware.gpus_per_node": 8,
            "network.fabric": "tcp",
            "hardware.gpu": "h100-80gb",
        },
    )
    assert any("fabric bandwidth unknown" in x for x in plan.speed.get("not_counted", []))


def test_a_slower_override_is_allowed_and_named():
    plan, found = searched(*SHAPE, "training.global_batch=16", "overrides.micro_batch=2")
    assert plan.parallel.micro_batch == 2
    assert found.forced_cost and found.forced_cost > 0.2
    assert any("overrides.micro_batch as set is predicted" in w and "slower" in w for w in plan.warnings)


def test_cli_explain_table_json_and_plot(tmp_path):
    args = ["plan", "--gpu", "h200-141gb", "--gpus-per-node", "1", "--model", "deepseek-v2-lite"]
    args += [
        "--set",
        "model.num_layers=4",
        "--set",
        "training.seq_len=4096",
        "--set",
        "training.global_batch=16",
    ]
    r = dskit(*args, "--explain", "--plot", str(tmp_path / "c.png"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "predicted" in lines[0] and "tokens/s/GPU" in lines[0]
    assert any(line.rstrip().endswith("chosen") for line in lines)
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    j = json.loads(dskit(*args, "--explain", "--json").stdout)
    assert j["plan"]["speed"]["tokens_per_s_per_gpu"] > 0
    verdicts = [c["verdict"] for c in j["candidates"]]
    assert verdicts[0] == "chosen" and len(verdicts) == 20
    bad = dskit(*args, "--plot", str(tmp_path / "c.jpg"))
    assert bad.returncode == 2 and "--plot" in bad.stderr and bad.stderr.count("\n") == 1
    assert not (tmp_path / "c.jpg").exists()


def test_cpu_plans_keep_the_fit_order():
    """No GPU peak, nothing to time: the largest micro-batch that fits, no checkpointing, no speed."""
    plan, _ = build_plan_searched(
        load_spec(
            sets=["training.seq_len=128", "training.global_batch=16"],
            flags={"hardware.gpu": "cpu", "model.preset": "tiny-v2", "hardware.gpus_per_node": 2},
        )
    )
    assert (
        plan.speed is None and plan.parallel.micro_batch == 8 and plan.parallel.activation_checkpointing == 0
    )


@pytest.mark.parametrize("gpu", sorted(catalog.gpus()))
@pytest.mark.parametrize("model", sorted(catalog.models()))
def test_explain_works_for_every_catalog_model_and_gpu(model, gpu):
    """A table, or the one-line refusal with the numbers: never a crash."""
    from dskit.errors import SpecError
    from dskit.explain import row_dict, table

    per_node = 2 if gpu == "cpu" else 8
    sets = ["training.seq_len=256"] if model.startswith("tiny") else []
    try:
        plan, found = build_plan_searched(
            load_spec(
                sets=sets,
                flags={"hardware.gpu": gpu, "model.preset": model, "hardware.gpus_per_node": per_node},
            )
        )
    except SpecError as e:
        assert e.field and "\n" not in e.message
        return
    text = table(plan, found)
    assert text.splitlines()[0] == plan.summary() and "chosen" in text
    assert json.dumps([row_dict(r) for r in found.rows])
    assert (plan.speed is None) == (gpu == "cpu")
