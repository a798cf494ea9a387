"""The plan's decisions: every number the run needs, decided once from the spec and the catalogs.

`build_plan(spec)` is the only place values are computed; what it returns is `dskit/plan/schema.py`'s
`Plan`. Renderers map a `Plan` into templates; the trainer reads the same `Plan` back from run.yaml
(`schema.load_plan`) and never imports this module. Nothing downstream recomputes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from dskit import catalog, hf_checkpoint
from dskit.contract import Env
from dskit.errors import SpecError, one_of
from dskit.plan import fit, memory, search, speed
from dskit.plan.deepspeed import deepspeed_config
from dskit.plan.model_math import ModelCounts, counts, flops_per_token
from dskit.plan.schema import (
    PLAN_VERSION,
    HardwarePlan,
    LaunchPlan,
    ModelPlan,
    OptimPlan,
    ParallelPlan,
    Plan,
    RayPlan,
    RunPlan,
)
from dskit.plan.watchdog import watchdog_timeout_s
from dskit.spec import Spec
from dskit.text import describe, first_unsafe

DEFAULT_MODEL = "deepseek-v2-lite"


def _pick_ep(n_experts: int, world: int, per_node: int, forced: int | None) -> int:
    if forced is not None:
        if n_experts % forced or world % forced:
            raise SpecError(
                "overrides.ep_size",
                f"{forced} must divide both the expert count ({n_experts}) and the world size ({world}); "
                f"valid: {', '.join(str(d) for d in _divisors(math.gcd(n_experts, world)))}",
            )
        return forced
    # Largest size that divides both and stays inside a node, so the all-to-all runs on NVLink.
    return max(d for d in _divisors(math.gcd(n_experts, world)) if d <= per_node)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _precision(spec: Spec, gpu: catalog.GPU) -> str:
    want = spec.overrides.precision
    if want == "bf16" and not gpu.bf16:
        raise SpecError("overrides.precision", f"{gpu.name} has no bf16; one of: auto, fp16")
    if want == "auto":
        return "bf16" if gpu.bf16 else "fp16"
    return want


def _attention(spec: Spec, gpu: catalog.GPU) -> str:
    """The backend the trainer runs: the profile's default for auto, else the pinned one if the GPU can
    run it (catalog.attention_unmet holds the rule), so a kernel the GPU lacks fails here, not at step 1."""
    want = spec.overrides.attention
    if want == "auto":
        return gpu.attention
    unmet = catalog.attention_unmet(gpu, want)
    if unmet is not None:
        sm = "no CUDA device" if gpu.is_cpu else "sm" + gpu.compute_capability.replace(".", "")
        raise SpecError(
            "overrides.attention",
            f"{want} cannot run on {gpu.name} ({sm}): {unmet}; {one_of(['auto', *gpu.attention_backends])}",
        )
    return want


def _micro_batch_splits(per_rank: int, micro_batch: int) -> bool:
    """What `overrides.micro_batch` must meet: whole micro-steps (grad_accum = per_rank / micro_batch).
    Any such value is taken; whether it fits in memory is the search's to say."""
    return per_rank % micro_batch == 0


#: the refusal lists every valid micro-batch up to this many, else the smallest and largest few
_LIST_AT_MOST = 12
#: candidates tried from below (their cofactors give the large ones): bounds the refusal's cost
_SCAN = 100_000


def _valid_micro_batches(per_rank: int) -> str:
    """The values `_micro_batch_splits` accepts for `per_rank`, for a refusal: each one is checked by
    that rule (no second definition of valid), listed whole when short, else described compactly."""
    root = math.isqrt(per_rank)
    small = [m for m in range(1, min(root, _SCAN) + 1) if _micro_batch_splits(per_rank, m)]
    large = [per_rank // m for m in reversed(small) if _micro_batch_splits(per_rank, per_rank // m)]
    if root > _SCAN:  # the middle was not searched: name the rule and the ends found
        return f"the divisors of {per_rank}, e.g. {', '.join(map(str, [*small[:4], '...', *large[-2:]]))}"
    valid = sorted(set(small + large))
    if len(valid) <= _LIST_AT_MOST:
        return ", ".join(map(str, valid))
    ends = [*map(str, valid[:6]), "...", *map(str, valid[-3:])]
    return f"the {len(valid)} divisors of {per_rank}: {', '.join(ends)}"


def _micro_batch_candidates(per_rank: int) -> list[int]:
    """The planner's own micro-batch search (powers of two that split the batch); a pinned value may be
    any divisor (`_micro_batch_splits`)."""
    return [m for m in (64, 32, 16, 8, 4, 2, 1) if per_rank % m == 0]


#: ZeRO stages searched, in the fit order (3 first: the path every plan took before stages 1 and 2)
ZERO_STAGES = (3, 2, 1)
CPU_MAX_MICRO_BATCH = 8  # CPU runs: a small micro-batch keeps 2-core test machines responsive
#: activation checkpointing searched, in the fit order: off, every 2nd layer, every layer (why not every
#: 3rd and beyond: dskit/plan/search.py)
CKPT_EVERY_CHOICES = (0, 2, 1)


def _host_memory(spec: Spec, gpu: catalog.GPU) -> tuple[float | None, str]:
    """Host RAM per node and where it came from: the spec, else the GPU type's reference node."""
    if spec.hardware.host_memory_gib is not None:
        return spec.hardware.host_memory_gib, "hardware.host_memory_gib"
    per_gpu = gpu.host_memory_gib_per_gpu
    if per_gpu is None:
        return None, "unknown"
    n = spec.hardware.gpus_per_node
    return float(per_gpu * n), f"default: {per_gpu:g} GiB per {gpu.name} of its reference node x {n}"


def _search(
    spec: Spec,
    shape: fit.Shape,
    per_rank: int,
    speed_of: search.SpeedOf,
    fabric_name: str,
    warnings: list[str],
) -> search.Search:
    """The fastest candidate that fits (`dskit/plan/search.py`), else SpecError (exit 2).

    EP sizes: every divisor of both the expert count and the world size (AutoEP takes any), inside a
    node or across nodes, where the all-to-all runs over the fabric. ZeRO stages 3, 2 and 1; optimizer
    offload only with stage 3 (its host-memory and speed terms are stage 3's). Pinned overrides shrink
    the candidate lists; the planner's own pick is still computed, so a slower forced choice is named.
    """
    o = spec.overrides
    n_experts, world, per_node = shape.cfg["n_routed_experts"], shape.world, shape.per_node
    eps = _divisors(math.gcd(n_experts, world))
    stages = list(ZERO_STAGES)
    if shape.gpu.is_cpu:  # no step-time model to weigh them: the fit order's first, as always taken
        eps = [max(d for d in eps if d <= per_node)]
        stages = [3]
    free_mbs = [
        m for m in _micro_batch_candidates(per_rank) if not shape.gpu.is_cpu or m <= CPU_MAX_MICRO_BATCH
    ]
    # the fit order: inside a node before across nodes (largest first in each)
    eps = sorted((d for d in eps if d <= per_node), reverse=True) + [d for d in eps if d > per_node]
    free = ([False, True], eps, free_mbs, list(CKPT_EVERY_CHOICES), stages)
    pinned = (
        {"none": [False], "cpu": [True], "auto": free[0]}[o.offload_optimizer],
        [o.ep_size] if o.ep_size is not None else free[1],
        [o.micro_batch] if o.micro_batch else free[2],
        [o.activation_checkpointing] if o.activation_checkpointing is not None else free[3],
        [o.zero_stage] if o.zero_stage is not None else free[4],
    )
    if o.zero_stage is not None and o.zero_stage != 3 and o.offload_optimizer == "cpu":
        raise SpecError(
            "overrides.offload_optimizer",
            f"cpu is searched with ZeRO-3 only, and overrides.zero_stage is {o.zero_stage}; "
            "one of: auto, none (or overrides.zero_stage 3)",
        )
    forced = [
        key
        for key, on in (
            ("overrides.offload_optimizer", o.offload_optimizer != "auto"),
            ("overrides.ep_size", o.ep_size is not None),
            ("overrides.micro_batch", o.micro_batch is not None),
            ("overrides.activation_checkpointing", o.activation_checkpointing is not None),
            # last: the refusal names forced[0], and a stage rarely is what does not fit
            ("overrides.zero_stage", o.zero_stage is not None),
        )
        if on
    ]

    def candidates(
        offloads: list[bool], eps: list[int], mbs: list[int], ckpts: list[int], stages: list[int]
    ) -> list[fit.Candidate]:
        # the fit order (used where no speed is predicted): ZeRO-3, no offload first, largest EP inside a
        # node, largest micro-batch, no ckpt
        return [
            fit.Candidate(ep, mb, ck, off, st)
            for st in stages
            for off in offloads
            if not (off and st != 3)
            for ep in eps
            for mb in mbs
            for ck in ckpts
        ]

    forced_ep = o.ep_size

    def ep_for(world: int) -> int:
        keep = forced_ep is not None and world % forced_ep == 0 and n_experts % forced_ep == 0
        return forced_ep if keep else _pick_ep(n_experts, world, per_node, None)

    found = search.search(
        shape,
        candidates(*pinned),
        unforced=candidates(*free),
        forced=forced,
        per_rank=per_rank,
        speed_of=speed_of,
        ep_for=ep_for,
    )
    if found.chosen.candidate.offload:
        if o.offload_optimizer == "cpu":
            warnings.append("optimizer states offloaded to CPU: set by overrides.offload_optimizer")
        elif any(r.fits and not r.candidate.offload for r in found.rows):
            warnings.append(
                "optimizer states offloaded to CPU: predicted faster than every fitting plan without it"
            )
        else:
            warnings.append("optimizer states offloaded to CPU: no plan without it fits; expect slower steps")
    if found.chosen.speed and found.chosen.speed.unknown:
        warnings.append(
            f"speed not compared on network.fabric {fabric_name}: {'; '.join(found.chosen.speed.unknown)}; "
            "the plan takes the fit order (ZeRO-3, largest EP inside a node, largest micro-batch)"
        )
    cost = found.forced_cost
    if cost is not None and cost > search.SPEED_TIE:
        own = found.unforced_best.candidate.describe()  # type: ignore[union-attr]
        warnings.append(
            f"{', '.join(forced)} as set is predicted {cost:.0%} slower than the planner's own choice ({own})"
        )
    return found


def _speed_section(found: search.Search) -> dict[str, Any] | None:
    """The winner's predicted step time; with overrides that cost speed, what they cost."""
    if not found.chosen.speed:
        return None
    d = found.chosen.speed.as_dict()
    cost = found.forced_cost
    if cost is not None and cost > search.SPEED_TIE:
        d["overrides_cost"] = round(cost, 3)  # predicted share of tokens/s given up to the overrides
    return d


def build_plan(spec: Spec) -> Plan:
    """The plan in named steps, each a function of the spec and the steps before it."""
    return build_plan_searched(spec)[0]


def build_plan_searched(spec: Spec) -> tuple[Plan, search.Search]:
    """The plan and every candidate the planner weighed (`dskit plan --explain`)."""
    warnings: list[str] = []
    gpu = catalog.gpu(spec.hardware.gpu)
    fabric = resolve_fabric(spec, gpu)
    model, model_counts = plan_model(spec)
    precision = _precision(spec, gpu)
    hardware = plan_hardware(spec, gpu, precision)
    parallel, found = plan_parallel(spec, model, model_counts, gpu, fabric, hardware, precision, warnings)
    optim = plan_optim(spec)
    run, storage_root = plan_storage(spec)
    step_s = found.chosen.speed.step_s if found.chosen.speed else None
    timeout = watchdog_timeout_s(
        spec.watchdog.timeout_s,
        step_s=step_s,
        params_total=model.params_total,
        nodes=hardware.nodes,
        warnings=warnings,
    )
    run = run.model_copy(update={"watchdog_timeout_s": timeout})
    launch = plan_launch(spec, gpu, fabric, storage_root)
    plan = Plan(
        version=PLAN_VERSION,
        name=spec.name,
        model=model,
        hardware=hardware,
        parallel=parallel,
        optim=optim,
        run=run,
        launch=launch,
        slurm=spec.slurm,
        kubernetes=spec.kubernetes,
        ray=plan_ray(spec),
        memory=found.chosen.fit.as_dict(),
        speed=_speed_section(found),
        env=launch_env(spec, gpu, fabric, run, launch),
        deepspeed=deepspeed_config(model, hardware, parallel, optim),
        warnings=warnings,
        spec=spec.model_dump(mode="json"),
    )
    return plan, found


def resolve_fabric(spec: Spec, gpu: catalog.GPU) -> catalog.Fabric:
    """The spec's fabric; a CPU plan has no RDMA device, so an RDMA fabric (the default) becomes tcp."""
    fabric = catalog.fabric(spec.network.fabric)
    if gpu.is_cpu and fabric.rdma:
        fabric = catalog.fabric("tcp")
    if spec.network.ib_hca and not fabric.rdma:
        raise SpecError("network.ib_hca", f"only applies to RDMA fabrics; {fabric.name} is not one")
    return fabric


def plan_model(spec: Spec) -> tuple[ModelPlan, ModelCounts]:
    """The model: preset or local checkpoint, layers truncated, parameter and FLOP counts."""
    if spec.model.path:
        preset = catalog.model_from_path(spec.model.path)
        weights_path = None  # a config alone: random init from it
        if hf_checkpoint.has_weights(spec.model.path):
            hf_checkpoint.check_checkpoint(spec.model.path)  # a broken checkpoint fails here, not in the job
            weights_path = str(Path(spec.model.path).resolve())
    else:
        preset, weights_path = catalog.model(spec.model.preset or DEFAULT_MODEL), None
    cfg = dict(preset.config)
    if spec.model.num_layers is not None:
        if spec.model.num_layers > cfg["num_hidden_layers"]:
            raise SpecError("model.num_layers", f"{preset.name} has only {cfg['num_hidden_layers']} layers")
        cfg["num_hidden_layers"] = spec.model.num_layers
    seq_len = spec.training.seq_len
    if seq_len > cfg.get("max_position_embeddings", seq_len):
        raise SpecError(
            "training.seq_len",
            f"{seq_len} exceeds the model's max_position_embeddings ({cfg['max_position_embeddings']})",
        )
    balance = preset.balance or {}
    aux = spec.training.aux_loss_coeff
    mc = counts(cfg, seq_len)
    model = ModelPlan(
        name=preset.name,
        source=preset.source,
        trainable=preset.trainable,
        untrainable_reason=preset.untrainable_reason,
        path=weights_path,
        config=cfg,
        aux_loss_coeff=aux if aux is not None else float(balance.get("aux_loss_alpha", 0.0)),
        seq_aux=bool(balance.get("seq_aux", True)),
        params_total=mc.total,
        params_active=mc.active,
        flops_per_token=flops_per_token(mc),
    )
    return model, mc


def plan_hardware(spec: Spec, gpu: catalog.GPU, precision: str) -> HardwarePlan:
    nodes, per_node = spec.hardware.nodes, spec.hardware.gpus_per_node
    host_gib, _ = _host_memory(spec, gpu)
    return HardwarePlan(
        gpu=gpu.name,
        on_gpu=not gpu.is_cpu,
        nodes=nodes,
        procs_per_node=per_node,
        world_size=nodes * per_node,
        usable_memory_gib=gpu.usable_memory_gib,
        host_memory_gib=host_gib,
        peak_tflops=gpu.peak_tflops_bf16 if precision == "bf16" else gpu.peak_tflops_fp16,
    )


def plan_parallel(
    spec: Spec,
    model: ModelPlan,
    model_counts: ModelCounts,
    gpu: catalog.GPU,
    fabric: catalog.Fabric,
    hardware: HardwarePlan,
    precision: str,
    warnings: list[str],
) -> tuple[ParallelPlan, search.Search]:
    """EP size and batch split, checkpointing and offload: the fastest candidate that fits
    (`dskit/plan/search.py`), and the attention backend."""
    cfg, world, per_node = model.config, hardware.world_size, hardware.procs_per_node
    if spec.overrides.ep_size is not None:  # checked here: one line naming the valid sizes
        _pick_ep(cfg["n_routed_experts"], world, per_node, spec.overrides.ep_size)
    gb = global_batch(spec.training.global_batch, world)
    if gb % world:
        lo, hi = (gb // world) * world, (gb // world + 1) * world
        nearest = ", ".join(str(x) for x in dict.fromkeys((lo or hi, hi)))
        raise SpecError(
            "training.global_batch",
            f"{gb} is not divisible by the world size {world}; nearest: {nearest}",
        )
    per_rank = gb // world
    forced_mb = spec.overrides.micro_batch
    if forced_mb is not None and not _micro_batch_splits(per_rank, forced_mb):
        raise SpecError(
            "overrides.micro_batch",
            f"{forced_mb} does not divide the per-rank batch {per_rank} "
            f"(global_batch {gb} / world {world}); valid: {_valid_micro_batches(per_rank)}",
        )
    host_gib, host_from = _host_memory(spec, gpu)
    seq_len = spec.training.seq_len
    compiled = regional_compile(spec.overrides.compile, gpu)
    if compiled and gpu.is_cpu:
        warnings.append(
            "overrides.compile=on on the cpu profile: inductor builds C++ at the first step, which needs a C++ "
            "compiler (dskit's CPU image has none) and takes longer than short runs save"
        )
    shape = fit.Shape(
        model=model.name,
        cfg=cfg,
        counts=model_counts,
        seq_len=seq_len,
        gpu=gpu,
        nodes=hardware.nodes,
        per_node=per_node,
        host_memory_gib=host_gib,
        host_memory_from=host_from,
        loads_weights=model.path is not None,
        loss=spec.overrides.loss,
        compiled=compiled,
    )

    def speed_of(c: fit.Candidate) -> speed.StepTime | None:
        return speed.predict(
            cfg,
            model_counts,
            model.flops_per_token,
            gpu=gpu,
            peak_tflops=hardware.peak_tflops,
            fabric_gbs=fabric.gbs_per_gpu,
            layout=speed.Layout(world=world, per_node=per_node, ep_size=c.ep_size),
            micro_batch=c.micro_batch,
            grad_accum=per_rank // c.micro_batch,
            seq_len=seq_len,
            ckpt_every=c.ckpt_every,
            offload=c.offload,
            compiled=compiled,
            zero_stage=c.zero_stage,
        )

    found = _search(spec, shape, per_rank, speed_of, fabric.name, warnings)
    c = found.chosen.candidate
    parallel = ParallelPlan(
        zero_stage=c.zero_stage,
        ep_size=c.ep_size,
        expert_dp_size=world // c.ep_size,
        micro_batch=c.micro_batch,
        grad_accum=per_rank // c.micro_batch,
        global_batch=gb,
        seq_len=seq_len,
        activation_checkpointing=c.ckpt_every,
        precision=precision,
        attention=_attention(spec, gpu),
        offload_optimizer=c.offload,
        loss_chunk_tokens=memory.loss_chunk_for(cfg, c.micro_batch * seq_len, spec.overrides.loss),
        compile_regions=compiled,
    )
    return parallel, found


#: the default global batch: 256 sequences (~1M tokens at seq 4096, the seed post's batch) ...
DEFAULT_GLOBAL_BATCH = 256
#: ... or this many per GPU where that is more (clusters of more than 64 GPUs): one sequence per GPU
#: would leave ZeRO's per-micro-step collectives and the per-layer costs unamortised. DeepSeek trained V2
#: with 2304-9216 sequences per step and V3 with 3072-15360 (the V2 and V3 reports); 4 per GPU is 1024
#: at 256 GPUs and 4096 at 1024.
DEFAULT_SEQUENCES_PER_GPU = 4


def global_batch(given: int | None, world: int) -> int:
    """`training.global_batch`, or the default: DEFAULT_GLOBAL_BATCH or DEFAULT_SEQUENCES_PER_GPU x the
    world size, whichever is larger, rounded up to a multiple of the world size."""
    if given is not None:
        return given
    want = max(DEFAULT_GLOBAL_BATCH, DEFAULT_SEQUENCES_PER_GPU * world)
    return -(-want // world) * world


def regional_compile(choice: str, gpu: catalog.GPU) -> bool:
    """`overrides.compile` -> whether the trainer compiles its regions. auto: on GPUs, where it measured
    faster and smaller (bench/README.md); off on the cpu profile, whose runs are tests and short: there
    inductor's C++ compile takes longer than it saves."""
    return choice == "on" or (choice == "auto" and not gpu.is_cpu)


def plan_optim(spec: Spec) -> OptimPlan:
    t = spec.training
    return OptimPlan(
        steps=t.steps,
        lr=t.lr,
        min_lr=t.lr * t.min_lr_ratio,
        warmup_steps=round(t.steps * t.warmup_ratio),
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
    )


def _run_root(spec: Spec) -> tuple[str, str]:
    """(storage root, ROOT/NAME). Relative paths mean "relative to where you rendered": absolute now,
    since jobs start elsewhere (the Slurm spool, a container's workdir)."""
    root = os.path.abspath(spec.storage.root)
    return root, f"{root.rstrip('/')}/{spec.name}"


def plan_storage(spec: Spec) -> tuple[RunPlan, str]:
    """Where the run reads and writes, all absolute; returns the run section and the storage root."""
    storage = spec.storage
    root, run_root = _run_root(spec)
    ckpt_dir = (
        os.path.abspath(storage.checkpoint_dir) if storage.checkpoint_dir else f"{run_root}/checkpoints"
    )
    out_dir = os.path.abspath(storage.output_dir) if storage.output_dir else f"{run_root}/outputs"
    data_path = os.path.abspath(spec.data.path) if spec.data.path else None
    sources = None
    if spec.data.sources is not None:
        if data_path is not None:
            raise SpecError(
                "data.sources", "given with data.path; use one of them (a one-source mixture is data.path)"
            )
        sources = [(os.path.abspath(x.path), x.weight) for x in spec.data.sources]
    eval_path = os.path.abspath(spec.data.eval_path) if spec.data.eval_path else None
    for field, path in (
        ("storage.root", root),
        ("storage.checkpoint_dir", ckpt_dir),
        ("storage.output_dir", out_dir),
        ("data.path", data_path),
        ("data.eval_path", eval_path),
        *((f"data.sources[{i}].path", path) for i, (path, _) in enumerate(sources or [])),
    ):
        bad = first_unsafe(path or "")
        if bad is not None:  # the spec's strings are checked; the current directory may add one
            raise SpecError(field, f"{path} contains {describe(bad)}; use a path without it")
    for field, path in (("storage.checkpoint_dir", ckpt_dir), ("storage.output_dir", out_dir)):
        if os.path.dirname(path) == path:  # '/': the trainer creates, prunes and writes files there
            raise SpecError(field, f"{path} is a filesystem root; a directory of the run's own is allowed")
    if os.path.normpath(ckpt_dir) == os.path.normpath(out_dir):
        raise SpecError(
            "storage.output_dir", f"{out_dir} is also storage.checkpoint_dir; two different dirs are allowed"
        )
    run = RunPlan(
        seed=spec.training.seed,
        log_every=spec.training.log_every,
        data_path=data_path,
        data_sources=sources,
        eval_path=eval_path,
        packing=spec.data.packing,
        eval_every=spec.training.eval_every,
        eval_batches=spec.training.eval_batches,
        checkpoint_dir=ckpt_dir,
        output_dir=out_dir,
        checkpoint_every=spec.checkpoint.every,
        checkpoint_keep=spec.checkpoint.keep,
        checkpoint_final=spec.checkpoint.final,
        profile_steps=spec.training.profile_steps,
    )
    return run, root


def plan_ray(spec: Spec) -> RayPlan:
    _, run_root = _run_root(spec)
    path = os.path.abspath(spec.ray.storage_path) if spec.ray.storage_path else f"{run_root}/ray"
    return RayPlan(max_failures=spec.ray.max_failures, storage_path=path)


def plan_launch(spec: Spec, gpu: catalog.GPU, fabric: catalog.Fabric, storage_root: str) -> LaunchPlan:
    per_node = spec.hardware.gpus_per_node
    return LaunchPlan(
        runtime=spec.runtime.kind,
        image=spec.runtime.image,
        python=spec.runtime.python,
        mounts=list(spec.runtime.mounts),
        storage_root=storage_root,
        rdzv_port=29500,
        # /dev/shm: NCCL's intra-node transport and DataLoader workers use it; Docker's default is 64 MB.
        shm_bytes=(1 if gpu.is_cpu else max(16, 2 * per_node)) * 2**30,
        fabric=fabric.name,
        fabric_rdma=fabric.rdma,
        fabric_k8s_resource=fabric.k8s_resource,
    )


def launch_env(
    spec: Spec, gpu: catalog.GPU, fabric: catalog.Fabric, run: RunPlan, launch: LaunchPlan
) -> dict[str, str]:
    """The launch contract every target exports (dskit/contract.py), minus RUN_FILE."""
    per_node = spec.hardware.gpus_per_node
    omp = spec.hardware.cpus_per_node // per_node if spec.hardware.cpus_per_node else (1 if gpu.is_cpu else 8)
    env = {
        Env.GPU_PROFILE.value: gpu.name,
        Env.CHECKPOINT_DIR.value: run.checkpoint_dir,
        Env.OUTPUT_DIR.value: run.output_dir,
        Env.SHM_BYTES.value: str(launch.shm_bytes),
        # ZeRO-3 overlaps its all-gathers and reduce-scatters with compute on separate streams: keep
        # CUDA's 8 hardware queues (Megatron-style images set 1, which serialises them).
        Env.CUDA_DEVICE_MAX_CONNECTIONS.value: "8",
        # MoE token counts change the shapes every step: expandable segments stop the fragmentation
        # that shows up as reserved >> allocated (58.5 vs 51.7 GiB in the baseline).
        Env.PYTORCH_CUDA_ALLOC_CONF.value: "expandable_segments:True",
        Env.OMP_NUM_THREADS.value: str(max(1, omp)),
        **fabric.env,
    }
    if spec.network.interface:
        env["NCCL_SOCKET_IFNAME"] = spec.network.interface
        env["GLOO_SOCKET_IFNAME"] = spec.network.interface
    if spec.network.ib_hca:
        env["NCCL_IB_HCA"] = spec.network.ib_hca
    if gpu.is_cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env
