"""The planner weighs every candidate and takes the fastest that fits (dskit/plan/search.py, speed.py)."""

from __future__ import annotations

import json

import pytest

from dskit import catalog
from dskit.plan import speed
from dskit.plan.build import build_plan_searched
from dskit.plan.candidate import Candidate, Cluster, Workload
from dskit.plan.links import Links
from dskit.plan.model_math import counts, flops_per_token
from dskit.plan.shape import ModelShape
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
    """EP sizes x micro-batches x checkpointing (off, every 2nd, every layer) x offload, on two GPUs."""
    _, found = searched(*SHAPE, "training.global_batch=8", **{"hardware.gpus_per_node": 2})
    seen = {
        (r.candidate.ep_size, r.candidate.micro_batch, r.candidate.ckpt_every, r.candidate.offload)
        for r in found.rows
    }
    assert seen == {(e, m, k, o) for e in (1, 2) for m in (1, 2, 4) for k in (0, 2, 1) for o in (False, True)}


def test_recompute_is_chosen_only_when_it_pays():
    """No checkpointing where memory allows a large micro-step; with it, a bigger micro-step that the
    un-checkpointed candidates cannot reach must be predicted faster."""
    roomy, _ = searched(*SHAPE, "training.global_batch=2")
    assert roomy.parallel.activation_checkpointing == 0
    deep, found = searched("model.num_layers=12", "training.seq_len=4096", "training.global_batch=4")
    assert deep.parallel.activation_checkpointing == 1  # measured fastest on H200 (docs/planner.md)
    plain = [r for r in found.rows if r.fits and not r.candidate.ckpt_every and not r.candidate.offload]
    assert all(r.candidate.micro_batch < deep.parallel.micro_batch for r in plain)


ONE_GPU = speed.Layout(world=1, per_node=1, ep_size=1)


def _v2_lite_step(
    micro_batch: int = 2,
    grad_accum: int = 1,
    layout: speed.Layout = ONE_GPU,
    zero_stage: int = 3,
    fused: bool = True,
) -> speed.StepTime:
    """4-layer V2-Lite at seq 4096 on H200, as the calibration runs were (ZeRO-1/2 with the fused step
    unless `fused` is False)."""
    shape = ModelShape.from_config(dict(catalog.model("deepseek-v2-lite").config, num_hidden_layers=4))
    c = counts(shape, 4096)
    gpu = catalog.gpu("h200-141gb")
    return speed.predict(
        Workload(
            shape, c, flops_per_token(c), seq_len=4096, per_rank=micro_batch * grad_accum,
            fused_step=fused and zero_stage < 3,
        ),
        Candidate(ep_size=layout.ep_size, micro_batch=micro_batch, ckpt_every=0, offload=False, zero_stage=zero_stage),
        Cluster(gpu, world=layout.world, per_node=layout.per_node, peak_tflops=989),
        Links(gpu.interconnect_gbs, None),
    )  # fmt: skip


def test_small_micro_steps_are_host_bound_large_ones_gpu_bound():
    at = _v2_lite_step
    assert at(1).bound == "host" and at(16).bound == "GPU"
    assert at(16).tokens_per_s > 1.5 * at(1).tokens_per_s


def test_an_unknown_fabric_is_not_timed_as_free():
    """Several nodes over tcp (no bandwidth in the catalog): speed is not compared; the fit order
    decides (EP inside a node, largest micro-batch), the summary says the number is a bound, a warning
    says why. Leaving the term out would have made tcp look faster than InfiniBand."""
    flags = {"hardware.nodes": 2, "hardware.gpus_per_node": 8, "hardware.gpu": "h100-80gb"}
    tcp, _ = searched("training.global_batch=256", **flags, **{"network.fabric": "tcp"})
    ib, _ = searched("training.global_batch=256", **flags, **{"network.fabric": "infiniband"})
    assert tcp.parallel.ep_size == 8 and "at most" in tcp.summary()
    assert any("speed not compared on network.fabric tcp" in w for w in tcp.warnings)
    assert "at most" not in ib.summary() and not ib.speed.get("not_counted")
    assert not any("speed not compared" in w for w in ib.warnings)


def test_a_forced_ep_that_cannot_be_built_names_the_override():
    from dskit.errors import SpecError

    with pytest.raises(SpecError) as e:
        searched(
            "training.global_batch=1024",
            "overrides.ep_size=1",
            **{
                "hardware.gpu": "a100-40gb",
                "hardware.nodes": 64,
                "hardware.gpus_per_node": 8,
                "model.preset": "deepseek-v3",
            },
        )
    assert (
        e.value.field == "overrides.ep_size"
        and "the planner's own choice fits (ZeRO-3, EP " in e.value.message
    )


def test_offload_must_win_by_the_models_error():
    """Its host rate is measured on one machine only: a plan with offload loses to any fitting plan without it that is
    predicted within OFFLOAD_MARGIN of it (`search.offload_wins`); such a loser's verdict says so."""
    from dskit.plan import search

    plan, found = searched(
        **{
            "hardware.gpu": "v100-32gb",
            "hardware.nodes": 2,
            "hardware.gpus_per_node": 8,
            "model.preset": "deepseek-moe-16b",
        }
    )
    assert not plan.parallel.offload_optimizer
    faster = [
        r
        for r in found.rows
        if r.fits and r.candidate.offload and r.speed.tokens_per_s > found.chosen.speed.tokens_per_s
    ]
    assert faster and all(
        f"not more than the {search.OFFLOAD_MARGIN:.0%} an optimizer offload must win by" in r.verdict
        for r in faster
    )
    assert all(
        r.speed.tokens_per_s <= found.chosen.speed.tokens_per_s * (1 + search.OFFLOAD_MARGIN) for r in faster
    )
    forced, _ = searched(
        **{
            "overrides.offload_optimizer": "cpu",
            "hardware.gpu": "v100-32gb",
            "hardware.nodes": 2,
            "hardware.gpus_per_node": 8,
            "model.preset": "deepseek-moe-16b",
        }
    )
    assert "optimizer states offloaded to CPU: set by overrides.offload_optimizer" in forced.warnings


def test_a_tie_verdict_is_measured_from_the_fastest_and_names_the_reason():
    _, found = searched(
        **{
            "hardware.gpu": "a100-40gb",
            "hardware.gpus_per_node": 4,
            "model.preset": "deepseek-moe-16b",
            "training.seq_len": 2048,
            "training.global_batch": 256,
        }
    )
    fastest = max(r.speed.tokens_per_s for r in found.rows if r.fits)
    for r in found.rows[1:]:
        if r.fits and "tie" in r.verdict:
            assert r.speed.tokens_per_s >= fastest * 0.97 and "the winner" in r.verdict


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
    # micro-batches x checkpointing x (ZeRO-3 with and without offload, ZeRO-2, ZeRO-1)
    assert verdicts[0] == "chosen" and len(verdicts) == 5 * 3 * 4
    for where in (tmp_path / "c.jpg", tmp_path, tmp_path / "missing" / "c.png", "/proc/c.png"):
        bad = dskit(*args, "--plot", str(where))
        assert bad.returncode == 2 and "--plot" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
        assert bad.stdout == ""  # nothing printed before the failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.png"]  # no temporary left behind
    assert dskit(*args, "--plot", str(tmp_path / "upper.PNG")).returncode == 0


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


#: plans a one-node job of these must produce (they fit one node of that GPU)
MUST_PLAN = {
    ("deepseek-v2-lite", "h100-80gb"),
    ("deepseek-v2-lite", "h200-141gb"),
    ("deepseek-v2-lite", "a100-80gb"),
    ("deepseek-coder-v2-lite", "h100-80gb"),
    ("deepseek-moe-16b", "a100-40gb"),
    ("tiny-v2", "cpu"),
    ("tiny-v3", "cpu"),
}


@pytest.mark.parametrize("nodes", [1, 4])
@pytest.mark.parametrize("gpu", sorted(catalog.gpus()))
@pytest.mark.parametrize("model", sorted(catalog.models()))
def test_explain_works_for_every_catalog_model_and_gpu(model, gpu, nodes):
    """A table, or the one-line refusal with the numbers: never a crash."""
    from dskit.errors import SpecError
    from dskit.plan.explain import row_dict, table

    per_node = 2 if gpu == "cpu" else 8
    sets = ["training.seq_len=256"] if model.startswith("tiny") else []
    try:
        plan, found = build_plan_searched(
            load_spec(
                sets=sets,
                flags={
                    "hardware.gpu": gpu,
                    "model.preset": model,
                    "hardware.gpus_per_node": per_node,
                    "hardware.nodes": nodes,
                },
            )
        )
    except SpecError as e:  # only "does not fit" refusals, each with numbers and what to change
        assert e.field in ("hardware.nodes", "hardware.host_memory_gib") and "\n" not in e.message
        assert "GiB" in e.message and "use " in e.message
        assert (model, gpu) not in MUST_PLAN, e.message
        return
    text = table(plan, found)
    assert text.splitlines()[0] == plan.summary() and "chosen" in text
    assert json.dumps([row_dict(r) for r in found.rows])
    assert (plan.speed is None) == (gpu == "cpu")


def test_zero2_copies_gradients_every_micro_step_zero1_once_per_step():
    """On one GPU under DeepSpeed's step the copies are all that tell the stages apart: stage 2 pays them
    in each micro-step, on the GPU timeline; stage 1 once, after the last backward, with its boundary.
    With the fused step (bf16) the gradients go flat (dskit/train/flat_grads.py): no copy at all."""
    z2, z1, z3 = (_v2_lite_step(grad_accum=4, zero_stage=z, fused=False) for z in (2, 1, 3))
    for z in (2, 1):
        flat = _v2_lite_step(grad_accum=4, zero_stage=z)
        assert flat.grad_copy_s == 0.0 and flat.boundary_s == 0.0
    c = counts(
        ModelShape.from_config(dict(catalog.model("deepseek-v2-lite").config, num_hidden_layers=4)), 4096
    )
    copy = (
        c.total
        * (speed.ZERO12_BUCKET_BYTES_PER_PARAM + speed.ZERO12_PARTITION_BYTES_PER_PARAM)
        / (catalog.gpu("h200-141gb").memory_bw_gbs * speed.GB)
    )
    assert z2.grad_copy_s == pytest.approx(4 * copy) and z2.boundary_s == 0.0
    assert z1.grad_copy_s == 0.0 and z1.boundary_s == pytest.approx(copy)
    assert z3.grad_copy_s == 0.0 and z3.boundary_s == 0.0
    assert z1.step_s < z2.step_s
    assert _v2_lite_step(zero_stage=1, fused=False).step_s == pytest.approx(
        _v2_lite_step(zero_stage=2, fused=False).step_s
    )


def test_the_gradient_copy_buckets_every_held_gradient_and_partitions_each_over_its_group():
    """8 ranks, EP 4: every gradient a rank holds (the dense ones, its quarter of the experts) goes through
    a bucket; the fp32 copy is of its partition, the dense over 8 ranks, the experts over 8 / 4 = 2."""
    layout = speed.Layout(world=8, per_node=8, ep_size=4)
    c = counts(
        ModelShape.from_config(dict(catalog.model("deepseek-v2-lite").config, num_hidden_layers=4)), 4096
    )
    experts = c.experts_per_layer * c.moe_layers
    dense, routed = c.total - experts, experts / 4
    bw = catalog.gpu("h200-141gb").memory_bw_gbs * speed.GB
    want = (
        (dense + routed) * speed.ZERO12_BUCKET_BYTES_PER_PARAM
        + (dense / 8 + routed / 2) * speed.ZERO12_PARTITION_BYTES_PER_PARAM
    ) / bw
    assert _v2_lite_step(grad_accum=3, layout=layout, zero_stage=2).grad_copy_s == pytest.approx(3 * want)


V2_64 = {
    "hardware.gpu": "h100-80gb",
    "hardware.nodes": 8,
    "hardware.gpus_per_node": 8,
    "model.preset": "deepseek-v2",
}


def test_the_cpu_adam_rate_follows_the_hosts_cores():
    """An offloaded optimizer steps on the rank's OMP_NUM_THREADS cores (hardware.cpus_per_node / GPUs):
    four times the cores, a quarter of the CPU Adam time; the PCIe round trip stays."""
    few, _ = searched(**V2_64, **{"overrides.offload_optimizer": "cpu", "hardware.cpus_per_node": 32})
    many, _ = searched(**V2_64, **{"overrides.offload_optimizer": "cpu", "hardware.cpus_per_node": 128})
    assert few.env["OMP_NUM_THREADS"] == "4" and many.env["OMP_NUM_THREADS"] == "16"
    a, b = few.speed["optimizer_s"], many.speed["optimizer_s"]
    local = few.model.params_total / 64 / 1e9
    assert a - b == pytest.approx(local * speed.CPU_ADAM_CORE_S_PER_BPARAM * (1 / 4 - 1 / 16), rel=1e-2)


def test_plan_prints_the_yaml_alone_on_stdout(tmp_path):
    """`dskit plan > run.yaml` captures the plan and nothing else: the summary goes to stderr."""
    from dskit.plan.schema import dump_plan

    args = ["plan", "--gpu", "h200-141gb", "--gpus-per-node", "1", "--model", "deepseek-v2-lite"]
    r = dskit(*args, "--set", "model.num_layers=4")
    assert r.returncode == 0, r.stderr
    plan, _ = searched("model.num_layers=4")
    assert r.stdout == dump_plan(plan)
    assert r.stderr.splitlines()[-1] == plan.summary()


#: the words `dskit plan --help` names each dimension of the search by (dskit/plan/search.py `Axes`)
AXES_IN_HELP = {
    "stages": "ZeRO stage",
    "eps": "EP size",
    "micro_batches": "micro-batch x gradient accumulation",
    "ckpts": "activation checkpointing",
    "offloads": "optimizer offload",
}


def test_plan_help_names_every_dimension_the_search_weighs():
    import dataclasses

    from dskit.plan.search import Axes

    assert set(AXES_IN_HELP) == {f.name for f in dataclasses.fields(Axes)}  # a new dimension: name it here
    text = " ".join(dskit("plan", "--help", check=True).stdout.split())  # argparse wraps lines
    for words in AXES_IN_HELP.values():
        assert words in text, words
