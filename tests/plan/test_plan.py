"""The plan decides every number: EP size, batch split, precision, memory, DeepSpeed config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from dskit import catalog
from dskit.errors import SpecError
from dskit.plan import parallel
from dskit.plan.build import (
    build_plan,
    launch_env,
    plan_hardware,
    plan_launch,
    plan_model,
    plan_storage,
    resolve_fabric,
)
from dskit.plan.schema import PLAN_VERSION, dump_plan, load_plan
from dskit.plan.shape import ModelShape
from dskit.spec import load_spec
from tests.support.cli import cli


def plan_for(*sets: str, **flags):
    return build_plan(load_spec(sets=list(sets), flags={k.replace("__", "."): v for k, v in flags.items()}))


def test_default_two_node_plan():
    p = plan_for(hardware__nodes=2)
    assert p.hardware.world_size == 16
    # the step-time model's pick among ZeRO 1-3 and the divisors of 64: with 8 NICs per node a ZeRO-3
    # group spanning both nodes gathers at 8 x 50 GB/s (dskit/plan/links.py), and EP 1 needs no all-to-all
    assert p.parallel.zero_stage == 3 and p.parallel.ep_size == 1 and p.parallel.expert_dp_size == 16
    assert p.speed["tokens_per_s_per_gpu"] > 0 and p.speed["mfu"] > 0
    assert p.parallel.micro_batch * p.parallel.grad_accum * 16 == p.parallel.global_batch
    assert p.parallel.precision == "bf16" and p.parallel.attention == "flash_attention_4"
    ds = p.deepspeed
    assert ds["expert_parallel"] == {
        "enabled": True,
        "autoep_size": p.parallel.ep_size,
        "preset_model": "deepseek_v2",
    }
    zero = ds["zero_optimization"]
    assert (
        zero["stage"] == 3 and zero["stage3_max_live_parameters"] >= 10**9 and ds["bf16"] == {"enabled": True}
    )
    assert ds["train_batch_size"] == 256 and "fp16" not in ds
    m = p.memory
    assert (
        max(m["total_gib"], m["construction_gib"]) <= m["limit_gib"] and m["host_gib"] <= m["host_limit_gib"]
    )


def test_overlap_comm_only_where_there_is_communication_to_overlap():
    """With overlap_comm DeepSpeed synchronises the device before each gradient bucket's reduce; on one
    rank there is nothing to overlap (measured: the one-GPU step ran 12% faster at micro-batch 1, bench/JOURNAL.md)."""
    small = ("model.num_layers=4", "training.global_batch=2")
    one = plan_for(*small, hardware__gpu="h200-141gb", hardware__gpus_per_node=1)
    two = plan_for(*small, hardware__gpu="h200-141gb", hardware__gpus_per_node=2)
    assert one.hardware.world_size == 1 and two.hardware.world_size == 2
    assert one.parallel.zero_stage < 3 and one.deepspeed["zero_optimization"]["overlap_comm"] is False
    assert two.deepspeed["zero_optimization"]["overlap_comm"] is True
    # ZeRO-3's side streams and offload's copies to the host were measured with it, and keep it
    z3 = plan_for(*small, "overrides.zero_stage=3", hardware__gpu="h200-141gb", hardware__gpus_per_node=1)
    assert z3.deepspeed["zero_optimization"]["overlap_comm"] is True


def test_one_rank_gradients_go_flat_in_bf16_with_the_fused_step():
    """dskit/train/flat_grads.py: on one rank with the fused step in bf16 the gradients need no reduce
    bucket and no boundary copy; several ranks, fp16 and DeepSpeed's step keep DeepSpeed's path."""

    def flat(p) -> bool:  # the plan's decision, which the trainer obeys (dskit/train/entry.py)
        return p.parallel.gradients == "flat"

    small = ("model.num_layers=4", "training.global_batch=4", "overrides.zero_stage=2")
    one = plan_for(*small, hardware__gpu="h200-141gb", hardware__gpus_per_node=1)
    plain = plan_for(
        *small, "overrides.optimizer_step=deepspeed", hardware__gpu="h200-141gb", hardware__gpus_per_node=1
    )
    two = plan_for(*small, hardware__gpu="h200-141gb", hardware__gpus_per_node=2)
    assert flat(one) and not flat(plain) and not flat(two)
    assert one.memory["working_set_gib"] == 0 < plain.memory["working_set_gib"]  # the reduce bucket
    assert one.speed["grad_copy_s"] == 0 < plain.speed["grad_copy_s"]


def test_a_step_nothing_waits_for_overlaps_its_optimizer_with_the_next_step():
    """One rank's fused bf16 step reads nothing back, and a GPU's log record is written a step late
    (dskit/train/metrics.py): the host queues the next step while the GPU runs the optimizer, so the
    optimizer is on the GPU's timeline. DeepSpeed's step reads its overflow flag back: the host waits."""
    # 512 tokens a step: the host's timeline is the longer, where overlapping the optimizer counts
    small = (
        "model.num_layers=4",
        "training.seq_len=512",
        "training.global_batch=1",
        "overrides.zero_stage=2",
    )
    h200 = {"hardware__gpu": "h200-141gb", "hardware__gpus_per_node": 1}
    fused = plan_for(*small, **h200).speed
    plain = plan_for(*small, "overrides.optimizer_step=deepspeed", **h200).speed
    gpu_terms = ("compute_s", "layer_gpu_s", "collectives_s", "grad_copy_s", "all_to_all_s")

    def gpu(s: dict) -> float:
        return sum(s[k] for k in gpu_terms)

    assert fused["bound"] == plain["bound"] == "host" and fused["optimizer_s"] > 0 < plain["optimizer_s"]
    assert fused["step_s"] == pytest.approx(
        max(gpu(fused) + fused["optimizer_s"], fused["host_s"]) + fused["boundary_s"], abs=3e-4
    )
    assert plain["step_s"] == pytest.approx(
        max(gpu(plain), plain["host_s"]) + plain["optimizer_s"] + plain["boundary_s"], abs=3e-4
    )


def test_an_overlapped_optimizer_lengthens_the_gpu_timeline_it_joins():
    """GPU + optimizer longer than the host: the step is their sum, GPU-bound, where the optimizer after
    the micro-steps would have added the same; shorter than the host, the host's alone."""
    from dskit.plan.speed import StepTime

    def step(host_s: float, overlapped: bool) -> StepTime:
        return StepTime(
            compute_s=0.03, layer_gpu_s=0.01, collectives_s=0.0, grad_copy_s=0.0, all_to_all_s=0.0,
            host_s=host_s, optimizer_s=0.02, tokens_per_step=4096, flops_per_token=1e9, peak_tflops=989.0,
            unknown=(), boundary_s=0.001, optimizer_overlapped=overlapped,
        )  # fmt: skip

    gpu_bound = step(0.05, True)
    assert gpu_bound.step_s == pytest.approx(0.061) and gpu_bound.bound == "GPU"
    assert step(0.05, False).step_s == pytest.approx(0.071) and step(0.05, False).bound == "host"
    host_bound = step(0.07, True)
    assert host_bound.step_s == pytest.approx(0.071) and host_bound.bound == "host"
    assert host_bound.as_dict()["optimizer_overlapped"] is True
    assert "optimizer_overlapped" not in step(0.07, False).as_dict()


def test_autoeps_fused_combine_on_one_gpu_from_its_measured_size(monkeypatch):
    """AutoEP's fused top-k combine (dskit/plan/memory.py `fused_combine`): on a GPU, one rank, from
    FUSED_COMBINE_MIN_TOKENS tokens per micro-step; less memory than the eager weighted sum, the same
    predicted time (dskit/plan/speed.py: measured faster, but the fitted step already matches it)."""
    from dskit.plan import memory
    from dskit.plan.memory import FUSED_COMBINE_MIN_TOKENS

    def combine(*sets: str, gpus: int = 1, gpu: str = "h200-141gb"):
        p = plan_for("model.num_layers=4", *sets, hardware__gpu=gpu, hardware__gpus_per_node=gpus)
        tokens = p.parallel.micro_batch * p.parallel.seq_len
        return p, tokens, p.deepspeed["expert_parallel"].get("combine_impl", "weighted_sum")

    big, tokens, impl = combine(
        "training.seq_len=4096", "training.global_batch=16", "overrides.micro_batch=16"
    )
    assert tokens >= FUSED_COMBINE_MIN_TOKENS and impl == "fused_weighted_sum"
    small, tokens, impl = combine(
        "training.seq_len=4096", "training.global_batch=16", "overrides.micro_batch=4"
    )
    assert tokens < FUSED_COMBINE_MIN_TOKENS and impl == "weighted_sum"
    ranks = combine("training.seq_len=4096", "training.global_batch=32", "overrides.micro_batch=16", gpus=2)
    assert ranks[2] == "weighted_sum"  # several ranks: not measured there
    cpu = combine("training.seq_len=4096", "training.global_batch=16", "overrides.micro_batch=16", gpu="cpu")
    assert cpu[2] == "weighted_sum"  # a Triton kernel
    # against the same plan combining eagerly: the transients it does not allocate
    monkeypatch.setattr(memory, "FUSED_COMBINE", False)
    eager, *_ = combine("training.seq_len=4096", "training.global_batch=16", "overrides.micro_batch=16")
    cfg = big.model.config
    assert (eager.memory["activations_gib"] - big.memory["activations_gib"]) * 2**30 == pytest.approx(
        memory.combine_transient_bytes(ModelShape.from_config(cfg), 16 * 4096),
        abs=0.011 * 2**30,  # both rounded to 0.01 GiB
    )
    # and no time off: the model's step, fitted on the eager sum, already predicts the fused runs (speed.py)
    assert eager.speed["compute_s"] == big.speed["compute_s"]
    assert eager.speed["tokens_per_s_per_gpu"] == big.speed["tokens_per_s_per_gpu"]


def test_gpu_without_bf16_gets_fp16_with_dynamic_loss_scaling():
    p = plan_for("training.seq_len=128", hardware__gpu="v100-32gb", model__preset="tiny-v2")
    assert p.parallel.precision == "fp16" and p.parallel.attention == "sdpa"
    fp16 = p.deepspeed["fp16"]
    assert fp16["enabled"] and fp16["loss_scale"] == 0 and fp16["loss_scale_window"] == 2000
    with pytest.raises(SpecError, match="no bf16"):
        plan_for("overrides.precision=bf16", hardware__gpu="v100-32gb")


#: what each GPU generation can run for MLA (q/k 192, v 128), written out from the design facts rather
#: than from catalog.attention_unmet: cuDNN SDPA on sm90+; FlashAttention-2 built for sm80/86/89 only,
#: FlashAttention-4 (no compile, faster for MLA) for Hopper only
RUNNABLE_BY_SM_MAJOR = {
    None: {"sdpa", "eager"},  # the cpu profile
    7: {"sdpa", "eager"},
    8: {"sdpa", "flash_attention_2", "eager"},
    9: {"sdpa", "sdpa_cudnn", "flash_attention_4", "eager"},
}


@pytest.mark.parametrize("gpu", sorted(catalog.gpus()))
def test_an_attention_backend_the_gpu_cannot_run_is_refused_at_plan_time(gpu):
    """A pinned sdpa_cudnn on a V100 or A100 used to plan fine and die at the first step (the trainer
    allows only cuDNN's kernel there): now the plan refuses it, naming the GPU's own choices."""
    g = catalog.gpu(gpu)
    runnable = RUNNABLE_BY_SM_MAJOR[None if g.is_cpu else int(g.compute_capability.split(".")[0])]
    assert set(g.attention_backends) == runnable and g.attention in runnable
    tiny = {"model__preset": "tiny-v2", "hardware__gpu": gpu, "hardware__gpus_per_node": 2}
    assert plan_for("training.seq_len=128", **tiny).parallel.attention == g.attention  # auto
    for backend in catalog.ATTENTION_BACKENDS:
        pinned = ("training.seq_len=128", f"overrides.attention={backend}")
        if backend in runnable:
            assert plan_for(*pinned, **tiny).parallel.attention == backend
            continue
        with pytest.raises(SpecError) as e:
            plan_for(*pinned, **tiny)
        allowed = ", ".join(b for b in catalog.ATTENTION_BACKENDS if b in runnable)
        assert e.value.field == "overrides.attention"
        assert e.value.message.startswith(f"{backend} cannot run on {gpu} (")
        assert e.value.message.endswith(f"; one of: auto, {allowed}")


def test_v3_uses_its_autoep_preset():
    p = plan_for(model__preset="deepseek-v3", hardware__nodes=8)
    assert p.deepspeed["expert_parallel"]["preset_model"] == "deepseek_v3"


def test_global_batch_must_split_over_ranks():
    with pytest.raises(SpecError) as e:
        plan_for("training.global_batch=100", hardware__nodes=2)
    assert e.value.field == "training.global_batch" and "96, 112" in e.value.message


def test_forced_ep_must_divide_experts_and_world():
    with pytest.raises(SpecError) as e:
        plan_for("overrides.ep_size=3")
    assert e.value.field == "overrides.ep_size" and "valid: 1, 2, 4, 8" in e.value.message


def test_a_micro_batch_refusal_lists_exactly_the_values_that_are_accepted():
    """It used to list only powers of two ("valid: 2, 1") while 3 and 6 were accepted."""
    tiny = {"model__preset": "tiny-v2", "hardware__gpu": "cpu", "hardware__gpus_per_node": 2}
    with pytest.raises(SpecError) as e:  # per-rank batch 12 / 2 = 6
        plan_for("training.seq_len=128", "training.global_batch=12", "overrides.micro_batch=4", **tiny)
    assert e.value.field == "overrides.micro_batch" and e.value.message.endswith("; valid: 1, 2, 3, 6")
    listed = [int(v) for v in e.value.message.rsplit("valid: ", 1)[1].split(", ")]
    for mb in range(1, 13):
        sets = ("training.seq_len=128", "training.global_batch=12", f"overrides.micro_batch={mb}")
        if mb in listed:
            assert plan_for(*sets, **tiny).parallel.micro_batch == mb
        else:
            with pytest.raises(SpecError, match="valid: 1, 2, 3, 6"):
                plan_for(*sets, **tiny)
    with pytest.raises(SpecError) as e:  # many divisors: counted, with both ends
        plan_for("training.seq_len=128", "training.global_batch=1440", "overrides.micro_batch=7", **tiny)
    assert e.value.message.endswith("; valid: the 30 divisors of 720: 1, 2, 3, 4, 5, 6, ..., 240, 360, 720")


def test_too_big_for_the_cluster_is_refused_with_the_numbers():
    """V3 on 2 nodes of H100: each GPU would hold 1/16 of 1.3 TB of bf16 weights while building."""
    with pytest.raises(SpecError) as e:
        plan_for(model__preset="deepseek-v3", hardware__nodes=2)
    assert e.value.field == "hardware.nodes"
    msg = e.value.message
    assert "construction peaks at" in msg and "78.1 weight shard" in msg and "79.11 GiB usable" in msg
    # 7 fits with the regional compile's smaller activations (8 without: `overrides.compile=off`)
    assert "at least 7 nodes of 8" in msg


def test_offload_when_the_gpus_need_it_and_the_hosts_hold_it():
    p = plan_for(model__preset="deepseek-v3", hardware__nodes=16)
    assert p.parallel.offload_optimizer and any("offloaded" in w for w in p.warnings)
    m = p.memory
    # 671B x 18 B (fp32 states + pinned buffers) / 128 ranks x 8 per node, + 4 B x 1e9 init buffer and
    # 4 GiB per rank
    want = (8 * (671.0e9 * 18 / 128 + 4 * 1e9)) / 2**30 + 8 * 4
    assert m["host_training_gib"] == pytest.approx(want, rel=0.01)
    assert m["host_gib"] <= m["host_limit_gib"] == pytest.approx(0.9 * 2048)


def test_usable_memory_and_margin_not_the_datasheet():
    p = plan_for(
        "model.num_layers=4", "training.global_batch=2", hardware__gpu="h200-141gb", hardware__gpus_per_node=1
    )
    assert p.hardware.usable_memory_gib == p.memory["capacity_gib"] == pytest.approx(139.8, abs=0.01)
    assert p.memory["limit_gib"] == pytest.approx(0.9 * 139.8, abs=0.01)
    assert p.hardware.host_memory_gib == 256  # DGX H200: 2 TB / 8 GPUs, x 1 GPU per node


def test_construction_peak_of_one_v3_moe_layer():
    """All 256 routed experts of one V3 layer gathered in bf16: 256 x 3 x 7168 x 2048 x 2 B = 22.5 GB."""
    p = plan_for(model__preset="deepseek-v3", hardware__nodes=32)
    c = p.memory["construction"]
    assert c["gathered_gib"] * 2**30 == pytest.approx(256 * 3 * 7168 * 2048 * 2, rel=1e-3)
    assert c["autoep_copy_gib"] == pytest.approx(c["gathered_gib"] / p.parallel.ep_size, abs=0.01)
    assert c["shard_gib"] == pytest.approx(2 * p.model.params_total / 256 / 2**30, abs=0.01)
    assert p.memory["construction_gib"] == pytest.approx(sum(c.values()), abs=0.02)


def test_issue_examples():
    """Plans at the edges: V3 on 32 nodes of H100 fits every estimate; V2 on 8 nodes of H100 offloads
    its optimizer; V2-Lite on one H200 is refused.

    V3's default batch is 4 sequences per GPU there (1024). V2 at 8 sequences per GPU (512) fits micro-batch
    8 only with the optimizer offloaded, predicted more than the required 15% faster than every plan
    without it, and said so.

    V2-Lite on one H200 cannot train without offload (16 B x 15.7B = 234 GiB of states > 139.8 GiB), and
    offloading needs 18 B x 15.7B = 263 GiB of host RAM: more than a DGX H200's share (256 GiB per GPU)
    and twice the 128 GiB of the single-H200 machine here. So the plan refuses, and says what to change.
    """
    v3 = plan_for(model__preset="deepseek-v3", hardware__nodes=32)
    assert v3.parallel.global_batch == 1024
    v2 = plan_for("training.global_batch=512", model__preset="deepseek-v2", hardware__nodes=8)
    assert v2.parallel.micro_batch == 8
    assert v2.parallel.offload_optimizer and any(
        "predicted more than 15% faster than every fitting plan without it" in w for w in v2.warnings
    )
    for m in (v3.memory, v2.memory):
        assert (
            max(m["total_gib"], m["construction_gib"]) <= m["limit_gib"]
            and m["host_gib"] <= m["host_limit_gib"]
        )
    for host in (None, 128):
        sets = [] if host is None else [f"hardware.host_memory_gib={host}"]
        with pytest.raises(SpecError) as e:
            plan_for(
                *sets, model__preset="deepseek-v2-lite", hardware__gpu="h200-141gb", hardware__gpus_per_node=1
            )
        assert e.value.field == "hardware.host_memory_gib"
        assert "needs 271.0 GiB of host RAM per node" in e.value.message
        assert "nodes of 1 (hardware.nodes), or hosts with at least 301 GiB" in e.value.message


def test_overrides_that_do_not_fit_are_refused():
    with pytest.raises(SpecError) as e:
        plan_for("overrides.micro_batch=16", "overrides.loss=full", hardware__nodes=2)
    assert e.value.field == "overrides.micro_batch"
    assert "the planner's own choice fits (ZeRO-" in e.value.message and "micro-batch 8," in e.value.message
    with pytest.raises(SpecError) as e:
        plan_for("overrides.offload_optimizer=cpu", "hardware.host_memory_gib=64", hardware__nodes=1)
    assert e.value.field == "overrides.offload_optimizer"


def test_cli_refuses_a_plan_that_does_not_fit_with_exit_2(tmp_path):
    from tests.conftest import dskit

    r = dskit("render", "slurm", "--model", "deepseek-v3", "--nodes", "2", "-o", str(tmp_path / "run"))
    assert r.returncode == 2 and not (tmp_path / "run").exists()
    assert (
        r.stderr.count("\n") == 1
        and "hardware.nodes: deepseek-v3 on 2x8 h100-80gb cannot be built" in r.stderr
    )


def test_cpu_plans_check_host_memory_only_when_given():
    p = plan_for(
        "training.seq_len=128", model__preset="tiny-v2", hardware__gpu="cpu", hardware__gpus_per_node=2
    )
    assert p.memory["capacity_gib"] is None and p.memory["host_capacity_gib"] is None
    with pytest.raises(SpecError) as e:
        plan_for(
            "training.seq_len=128",
            "hardware.host_memory_gib=4",
            model__preset="tiny-v2",
            hardware__gpu="cpu",
            hardware__gpus_per_node=2,
        )
    assert e.value.field == "hardware.host_memory_gib"


def test_run_yaml_round_trips(tmp_path):
    p = plan_for(
        "training.seq_len=128", model__preset="tiny-v3", hardware__gpu="cpu", hardware__gpus_per_node=2
    )
    (tmp_path / "run.yaml").write_text(dump_plan(p))
    assert load_plan(tmp_path / "run.yaml") == p


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("[1, 2]", "must be a mapping"),
        (f"version: {PLAN_VERSION}\nname: x\n", "Field required"),
        ("a: [", "not valid YAML"),
        ("version: 99\n", "expected 2 or 3"),
    ],
)
def test_bad_run_yaml_is_one_clear_error(tmp_path, content, words):
    f = tmp_path / "run.yaml"
    f.write_text(content)
    with pytest.raises(SpecError, match=words.replace("[", r"\[")):
        load_plan(f)


def test_memory_watch_flags_steady_growth_only():
    from dskit.train.metrics import MemoryWatch

    leak, flat = MemoryWatch(), MemoryWatch()
    msgs = [leak.observe(s, {"host": 1 + s / 50}) for s in range(1, 101)]
    assert [m for m in msgs if m] and "host memory kept growing" in [m for m in msgs if m][0]
    assert not any(flat.observe(s, {"host": 2.0 + (s % 3) * 0.01}) for s in range(1, 101))


def test_memory_watch_samples_held_memory_not_freed_heap():
    """Freed chunks that glibc keeps mapped are not held memory: held_gib trims them before it samples
    (the CPU demo's raw RSS grew 4-10% over steps 60..100 with the heap in use flat)."""
    import torch

    from dskit.train.metrics import current_gib, held_gib, trim_host_heap

    if not trim_host_heap():
        pytest.skip("no malloc_trim in this C library")
    cpu = torch.device("cpu")
    base = held_gib(cpu)["host"]
    bufs = [bytearray(4096) for _ in range(32768)]  # 128 MiB of heap chunks, below mmap's threshold
    held = held_gib(cpu)["host"]
    bufs = bufs[::64]  # frees 63 of every 64: holes between live chunks, which free() keeps mapped
    freed_raw, freed_held = current_gib(cpu)["host"], held_gib(cpu)["host"]
    assert held - base > 0.1  # held memory counts
    assert freed_raw - freed_held > 0.05  # raw RSS still counts the holes ...
    assert freed_held - base < 0.05  # ... trimmed, they are gone
    del bufs


def test_allocator_retries_are_named_with_the_remedy():
    """Near capacity the caching allocator frees and retries (measured: 5x slower steps, bench/JOURNAL.md)."""
    import torch

    from dskit.train.metrics import alloc_retries, alloc_retry_warning

    assert alloc_retries(torch.device("cpu")) == 0  # a CPU run has no such allocator: no field, no warning
    msg = alloc_retry_warning(12, 10, 135.6, 139.8)
    assert "retried 12 time(s) over the last 10 step(s)" in msg and "135.6 of 139.8 GiB" in msg
    assert "overrides.micro_batch" in msg and "overrides.activation_checkpointing=1" in msg


def test_activation_checkpointing_only_when_memory_needs_it():
    roomy = plan_for(
        "model.num_layers=4", "training.global_batch=2", hardware__gpu="h200-141gb", hardware__gpus_per_node=1
    )
    assert roomy.parallel.activation_checkpointing == 0 and roomy.parallel.micro_batch == 2
    tight = plan_for(hardware__nodes=2)  # full V2-Lite, micro-batch 8 only fits with recomputation
    assert tight.parallel.activation_checkpointing == 1
    pinned = plan_for("overrides.activation_checkpointing=2", hardware__nodes=2)
    assert pinned.parallel.activation_checkpointing == 2


def test_loading_weights_adds_a_shard_per_rank_to_host_construction(tmp_path):
    """With model.path holding safetensors, each rank copies from one (up to 5 GB) shard while building."""
    from dskit.plan import host_memory

    (tmp_path / "config.json").write_text(json.dumps(catalog.model("tiny-v2").config))
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"lm_head.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    sets = ["training.seq_len=128", f"model.path={tmp_path}"]
    p = plan_for(*sets, hardware__gpu="h100-80gb", hardware__gpus_per_node=8)
    assert p.model.path == str(tmp_path.resolve())
    assert p.memory["host_construction_gib"] == pytest.approx(
        8 * (host_memory.HOST_BASELINE_GIB + 5e9 / 2**30), abs=0.01
    )
    with pytest.raises(SpecError) as e:
        plan_for(*sets, "hardware.host_memory_gib=64", hardware__gpu="h100-80gb", hardware__gpus_per_node=8)
    assert e.value.field == "hardware.host_memory_gib" and "69.3 while building" in e.value.message


def test_nothing_outside_the_planner_reads_the_spec_record():
    """run.yaml keeps `spec` for the record; renderers and the trainer read the typed sections."""
    root = Path(__file__).resolve().parents[2] / "dskit"
    readers = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.relative_to(root).parts[0] != "plan" and re.search(r"plan\.spec\b|\.spec\[", p.read_text())
    ]
    assert readers == []


def test_plan_steps_run_alone():
    spec = load_spec(None, ["storage.root=/s"], {"hardware.nodes": 2})
    model, _, model_counts = plan_model(spec)
    assert model.params_total == model_counts.total
    run, root = plan_storage(spec)
    assert root == "/s" and run.checkpoint_dir == "/s/dskit-run/checkpoints"
    gpu = catalog.gpu(spec.hardware.gpu)
    hardware = plan_hardware(spec, gpu, "bf16")
    assert hardware.world_size == 16
    fabric = resolve_fabric(spec, gpu)
    launch = plan_launch(spec, gpu, fabric, root)
    env = launch_env(spec, gpu, fabric, run, launch)
    assert env["DSKIT_CHECKPOINT_DIR"] == run.checkpoint_dir
    assert build_plan(spec).env == env


def test_a_cpu_plan_has_no_rdma_fabric():
    """The spec's default fabric is InfiniBand; a CPU plan has no RDMA device, so it resolves to tcp."""
    for fabric in ("infiniband", "roce", "efa"):
        plan = build_plan(load_spec(None, [], {"hardware.gpu": "cpu", "network.fabric": fabric}))
        assert (plan.launch.fabric, plan.launch.fabric_rdma, plan.launch.fabric_k8s_resource) == (
            "tcp",
            False,
            None,
        )
        assert plan.env["NCCL_IB_DISABLE"] == "1"
    with pytest.raises(SpecError, match="network.ib_hca"):
        build_plan(load_spec(None, ["network.ib_hca=mlx5_0"], {"hardware.gpu": "cpu"}))


def test_a_run_yaml_rendered_before_the_data_fields_still_loads():
    """A run in flight is requeued with the run.yaml it was rendered with: fields added since (data
    sources, eval, packing, compile) must have defaults. The file is slurm/tiny-v2-cpu-venv/run.yaml as
    rendered at commit a49b60e (PLAN_VERSION 3)."""
    plan = load_plan(Path(__file__).parents[1] / "fixtures" / "run-v3-before-data-fields.yaml")
    assert plan.run.data_sources is None and plan.run.packing == "pack" and plan.run.eval_every == 200
    assert not plan.parallel.compile_regions


def test_regional_compile_is_the_gpu_default_and_the_planner_counts_it(monkeypatch):
    """overrides.compile: auto compiles on GPUs (measured faster and smaller on H200, bench/JOURNAL.md) and not on the
    cpu profile; the plan's memory and step time are those of the compiled run, less than eager's."""
    from dskit.plan import memory

    monkeypatch.setattr(memory, "FUSED_COMBINE", False)  # its saving comes off compute_s: the compile's alone
    shape = ("model.num_layers=4", "training.seq_len=4096", "training.global_batch=16")
    flags = {"hardware__gpu": "h200-141gb", "hardware__gpus_per_node": 1, "model__preset": "deepseek-v2-lite"}
    # the regions alone here; compiling whole attention blocks too (compile=on, auto's ZeRO-1/2 default)
    # is pinned in test_zero12_plans_take_the_fused_step_and_compile_attention...
    auto, eager = (
        plan_for(*shape, "overrides.compile=regions", **flags),
        plan_for(*shape, "overrides.compile=off", **flags),
    )
    assert auto.parallel.compile_regions and not eager.parallel.compile_regions
    assert auto.parallel.micro_batch == eager.parallel.micro_batch == 16
    # 28.2 kB per token and layer (fp32 norm inputs, SiLU outputs) x 65536 tokens x 4 layers; measured
    # on H200: 6.5 GiB less allocated, 7.6 GiB less reserved (bench/results/training/h200-compile-gb16-2026-11-30.json)
    saved = eager.memory["activations_gib"] - auto.memory["activations_gib"]
    assert saved == pytest.approx(6.9, abs=0.1)
    assert auto.speed["compute_s"] == pytest.approx(0.9 * eager.speed["compute_s"], rel=1e-3)
    assert auto.speed["host_s"] == eager.speed["host_s"]  # host-bound steps measured no gain
    cpu = plan_for("training.seq_len=128", model__preset="tiny-v2", hardware__gpu="cpu")
    assert not cpu.parallel.compile_regions and not any("compile" in w for w in cpu.warnings)
    forced = plan_for(
        "training.seq_len=128", "overrides.compile=on", model__preset="tiny-v2", hardware__gpu="cpu"
    )
    assert forced.parallel.compile_regions
    assert any("C++ compiler" in w for w in forced.warnings)  # inductor's CPU backend; not in the CPU image
    assert "torch.compile regions" in auto.summary() and "torch.compile" not in eager.summary()


H200_MB2 = ("model.num_layers=4", "training.seq_len=4096", "training.global_batch=2")
H200 = {"model__preset": "deepseek-v2-lite", "hardware__gpu": "h200-141gb", "hardware__gpus_per_node": 1}


def test_zero12_plans_take_the_fused_step_and_compile_attention_zero3_keeps_deepspeeds():
    """The fused step and compiled attention apply where no ZeRO-3 hook or CPU optimizer is in their way."""
    p = plan_for(*H200_MB2, **H200)
    assert p.parallel.zero_stage == 2
    assert p.parallel.optimizer_step == "fused" and p.parallel.compile_attention
    assert "fused AdamW step" in p.summary()
    z3 = plan_for(*H200_MB2, "overrides.zero_stage=3", **H200)
    assert z3.parallel.optimizer_step == "deepspeed" and not z3.parallel.compile_attention
    off = plan_for(*H200_MB2, "overrides.offload_optimizer=cpu", **H200)
    assert off.parallel.optimizer_step == "deepspeed"
    regions = plan_for(*H200_MB2, "overrides.compile=regions", **H200)
    assert regions.parallel.compile_regions and not regions.parallel.compile_attention
    cpu = plan_for("overrides.zero_stage=2", hardware__gpu="cpu")
    assert cpu.parallel.optimizer_step == "fused" and not cpu.parallel.compile_attention
    on = plan_for(*H200_MB2, "overrides.compile=on", **H200)
    assert on.speed["compute_s"] < regions.speed["compute_s"] and on.speed["host_s"] < regions.speed["host_s"]


def test_the_fused_step_is_counted_and_a_forced_one_that_cannot_apply_is_named():
    fused, ds = (
        plan_for(*H200_MB2, "overrides.zero_stage=2", f"overrides.optimizer_step={s}", **H200)
        for s in ("auto", "deepspeed")
    )
    assert ds.parallel.optimizer_step == "deepspeed" and fused.parallel.optimizer_step == "fused"
    assert fused.speed["optimizer_s"] < ds.speed["optimizer_s"]
    z3 = plan_for(*H200_MB2, "overrides.zero_stage=3", "overrides.optimizer_step=fused", **H200)
    assert z3.parallel.optimizer_step == "deepspeed"
    assert any("overrides.optimizer_step=fused applies to ZeRO-1/2" in w for w in z3.warnings)


def test_run_yaml_from_before_the_fused_step_runs_deepspeeds(tmp_path):
    p = plan_for(*H200_MB2, **H200)
    data = p.model_dump(mode="json")
    for key in ("optimizer_step", "compile_attention"):
        del data["parallel"][key]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    old = load_plan(tmp_path / "run.yaml")
    assert old.parallel.optimizer_step == "deepspeed" and not old.parallel.compile_attention


def test_cuda_graphs_are_planned_only_where_a_graph_can_replay_and_on_elsewhere_names_what_is_missing(
    monkeypatch,
):
    """A graph replays fixed shapes on a GPU, over the attention blocks ZeRO-1/2 compiles whole, without
    activation checkpointing's recompute; auto leaves them off, as measured (0.86-0.98x on one H100)."""
    assert not plan_for(*H200_MB2, **H200).parallel.cuda_graphs
    on = plan_for(*H200_MB2, "overrides.cuda_graphs=on", **H200)
    assert on.parallel.cuda_graphs and on.parallel.compile_attention and on.parallel.zero_stage == 2
    assert "cuda_graphs: true" in dump_plan(on)
    # `on` narrows the search: full V2-Lite on 8 H100 would take ZeRO-3 with checkpointing
    wide = {"model__preset": "deepseek-v2-lite", "hardware__gpu": "h100-80gb"}
    assert plan_for(**wide).parallel.zero_stage == 3
    narrowed = plan_for("overrides.cuda_graphs=on", **wide).parallel
    assert narrowed.cuda_graphs and narrowed.zero_stage < 3 and narrowed.activation_checkpointing == 0
    with pytest.raises(SpecError) as e:  # where the narrowing leaves nothing, the refusal names it
        plan_for("overrides.cuda_graphs=on", **{**wide, "model__preset": "deepseek-v3"})
    assert e.value.field == "overrides.cuda_graphs" and "use overrides.cuda_graphs=off" in str(e.value)
    missing = {
        "a GPU": ("overrides.zero_stage=2", {**H200, "hardware__gpu": "cpu"}),
        "compiled attention blocks": ("overrides.compile=regions", H200),
        "rows of one shape (data.packing: pack)": ("data.packing=pad", H200),
        "ZeRO-1/2": ("overrides.zero_stage=3", H200),
        "no activation checkpointing": ("overrides.activation_checkpointing=1", H200),
    }
    for need, (pin, flags) in missing.items():
        with pytest.raises(SpecError) as e:
            plan_for(*H200_MB2, pin, "overrides.cuda_graphs=on", **flags)
        assert e.value.field == "overrides.cuda_graphs" and f"on needs {need}" in str(e.value), need
    monkeypatch.setattr(parallel, "CUDA_GRAPHS_FASTER", True)  # auto, where graphs measure faster
    assert plan_for(*H200_MB2, **H200).parallel.cuda_graphs
    for need, (pin, flags) in missing.items():
        assert not plan_for(*H200_MB2, pin, **flags).parallel.cuda_graphs, need  # quietly off there


H100_L8 = ("model.num_layers=8", "training.seq_len=2048", "training.global_batch=1")
H100 = {**H200, "hardware__gpu": "h100-80gb"}


def test_a_much_faster_plan_left_out_by_the_margin_alone_is_named_and_a_smaller_margin_takes_it():
    """8 layers of V2-Lite on one 80 GB GPU: resident ZeRO-2 is estimated a few GiB over the 90% limit, so the
    plan offloads the optimizer (measured 410 tokens/s on an H100, where torchtitan ran resident at 77.2 GiB:
    bench/results/peer/h100-host-bound-l8s2048-2026-12-05.json). The plan says what the margin costs."""
    offloaded = plan_for(*H100_L8, **H100)
    assert offloaded.parallel.offload_optimizer
    (line,) = [w for w in offloaded.warnings if "overrides.gpu_memory_margin=" in w]
    margin = float(line.split("overrides.gpu_memory_margin=")[1].split()[0])
    # of the candidates that would fit, the one needing the least memory: the largest margin, the least risk
    assert line.startswith("ZeRO-2, EP 1, micro-batch 1, activation checkpointing every 1, no offload is")
    assert margin == 0.08 and "over the 71.2 GiB limit (90% of 79.11 GiB usable)" in line
    resident = plan_for(*H100_L8, f"overrides.gpu_memory_margin={margin}", **H100)
    assert not resident.parallel.offload_optimizer and resident.parallel.activation_checkpointing == 1
    assert resident.speed["tokens_per_s_per_gpu"] > 10 * offloaded.speed["tokens_per_s_per_gpu"]
    # the next candidate out is named against the margin the spec set
    assert any("(92% of 79.11 GiB usable, overrides.gpu_memory_margin 0.08)" in w for w in resident.warnings)
    assert not any("gpu_memory_margin" in w for w in plan_for(*H200_MB2, **H200).warnings)  # nothing near
    # a candidate that would fit only within the 3% the estimate has measured below a peak is not offered:
    # V2-Lite on 4 H100 offloads, and ZeRO-3 at micro-batch 8, 17% faster, needs 78.95 of 79.11 GiB
    flags = ["--gpu", "h100-80gb", "--gpus-per-node", "4", "--model", "deepseek-v2-lite"]
    out = json.loads(cli("plan", *flags, "--explain", "--json", check=True).stdout)
    chosen = out["candidates"][0]
    assert chosen["offload_optimizer"] and not any("gpu_memory_margin" in w for w in out["plan"]["warnings"])
    tight = [
        r
        for r in out["candidates"]
        if 0.97 * 79.11 < max(r["memory"]["total_gib"], r["memory"]["construction_gib"]) <= 79.11
        and r["speed"]["tokens_per_s_per_gpu"] > 1.15 * chosen["speed"]["tokens_per_s_per_gpu"]
    ]
    assert tight  # what the floor keeps out
    for bad in ("0.02", "0.6"):
        with pytest.raises(SpecError) as e:
            plan_for(*H100_L8, f"overrides.gpu_memory_margin={bad}", **H100)
        assert e.value.field == "overrides.gpu_memory_margin"
