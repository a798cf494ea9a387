"""The plan's decisions: every number the run needs, decided once from the spec and the catalogs.

`build_plan(spec)` is the only place values are computed; what it returns is `dskit/plan/schema.py`'s
`Plan`. Renderers map a `Plan` into templates; the trainer reads the same `Plan` back from run.yaml
(`schema.load_plan`) and never imports this module. Nothing downstream recomputes.
"""

from __future__ import annotations

import os
from pathlib import Path

from dskit import catalog
from dskit.calibrate import calibration
from dskit.calibrate.calibration import Calibration
from dskit.errors import SpecError
from dskit.formats import hf_checkpoint
from dskit.io.text import describe, first_unsafe
from dskit.launch.contract import CHECKPOINTS_DIR, OUTPUTS_DIR, Env
from dskit.plan import host_memory, search
from dskit.plan.adapters import base_precision, plan_finetune
from dskit.plan.balancing import plan_balance
from dskit.plan.deepspeed import deepspeed_config
from dskit.plan.hang_timeout import watchdog_timeout_s
from dskit.plan.model_math import ModelCounts, counts, flops_per_token
from dskit.plan.parallel import Hardware, Trained, plan_parallel, speed_section
from dskit.plan.prefetch import gathered_layer_params
from dskit.plan.schema import (
    PLAN_VERSION,
    HardwarePlan,
    LaunchPlan,
    ModelPlan,
    OptimPlan,
    Plan,
    RayPlan,
    RunPlan,
)
from dskit.plan.shape import ModelShape
from dskit.spec import Spec, spec_record

DEFAULT_MODEL = "deepseek-v2-lite"


def _precision(spec: Spec, gpu: catalog.GPU) -> str:
    want = spec.overrides.precision
    if want == "bf16" and not gpu.bf16:
        raise SpecError("overrides.precision", f"{gpu.name} has no bf16; one of: auto, fp16")
    if want == "auto":
        return "bf16" if gpu.bf16 else "fp16"
    return want


def build_plan(spec: Spec) -> Plan:
    """The plan in named steps, each a function of the spec and the steps before it."""
    return build_plan_searched(spec)[0]


#: refusals of an fp8 base that a bf16 base may not share (ZeRO-3 holds a bf16 base, an fp8 one not yet)
_FP8_ONLY_REFUSALS = ("finetune.base_precision", "overrides.zero_stage")


def build_plan_searched(spec: Spec) -> tuple[Plan, search.Search]:
    """The plan and every candidate the planner weighed (`dskit plan --explain`). `base_precision: auto`
    resolves to fp8 for DeepSeek-V3's FP8 checkpoints; where an fp8 base cannot be planned (it trains
    under ZeRO-1/2 only, each GPU holding the non-expert base whole), auto takes bf16, dequantised while
    loading, and says so in a warning; an explicit fp8 keeps its refusal."""
    try:
        return _build_plan_searched(spec)
    except SpecError as e:
        auto = spec.finetune.method == "lora" and spec.finetune.base_precision == "auto"
        if (
            not auto
            or e.field not in _FP8_ONLY_REFUSALS
            or base_precision(spec.finetune, spec.model.path) != "fp8"
        ):
            raise
        why = str(e)
    bf16 = spec.model_copy(update={"finetune": spec.finetune.model_copy(update={"base_precision": "bf16"})})
    plan, found = _build_plan_searched(bf16)  # a bf16 base that does not fit either is refused as such
    plan.warnings.insert(
        0,
        "finetune.base_precision auto planned a bf16 base (the FP8 checkpoint dequantised while loading): "
        f"an fp8 base does not fit here ({why})",
    )
    return plan, found


def _build_plan_searched(spec: Spec) -> tuple[Plan, search.Search]:
    warnings: list[str] = []
    gpu = catalog.gpu(spec.hardware.gpu)
    fabric = resolve_fabric(spec, gpu)
    model, shape, model_counts = plan_model(spec)
    finetune, tuning = plan_finetune(spec.finetune, shape, model_counts, spec.model.path)
    if tuning is not None:  # a LoRA step's FLOPs: no weight-gradient GEMMs for the frozen base (MFU, speed)
        model = model.model_copy(update={"flops_per_token": tuning.flops_per_token(model_counts)})
    if finetune is not None and finetune.base_precision == "fp8" and not spec.model.path:
        warnings.append(
            "finetune.base_precision=fp8 on a catalog preset plans for sizing: the trainer reads the FP8 base "
            "from model.path (DeepSeek-V3's format) and refuses to start without it"
        )
    precision = _precision(spec, gpu)
    hardware = plan_hardware(spec, gpu, precision)
    calibration = plan_calibration(spec, gpu, fabric, hardware, warnings)
    parallel, found = plan_parallel(
        spec,
        Trained(model, shape, model_counts, tuning),
        Hardware(gpu, fabric, hardware, precision, calibration),
        warnings,
    )
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
        speed=speed_section(found),
        env=launch_env(spec, gpu, fabric, run, launch),
        deepspeed=deepspeed_config(
            model,
            hardware,
            parallel,
            optim,
            gathered_layer_params(model_counts, hardware.world_size, parallel.ep_size),
        ),
        warnings=warnings,
        spec=spec_record(spec),
        finetune=finetune,
        tracking=spec.tracking.for_run(spec.name),
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


def plan_calibration(
    spec: Spec, gpu: catalog.GPU, fabric: catalog.Fabric, hardware: HardwarePlan, warnings: list[str]
) -> Calibration | None:
    """The user's calibration (`hardware.calibration`), checked against this hardware, and its
    preflight findings as warnings; None without one."""
    if spec.hardware.calibration is None:
        return None
    cal = calibration.load(
        spec.hardware.calibration,
        field="hardware.calibration",
        gpu=gpu.name,
        fabric=fabric.name,
        procs_per_node=hardware.procs_per_node,
    )
    if hardware.peak_tflops is None and not (gpu.is_cpu and cal.compute.gemm_tflops):
        warnings.append(
            f"hardware.calibration: read and checked, but it measured no compute rate and the {gpu.name} "
            "profile has no peak, so no step time is predicted and its rates rank nothing"
        )
    elif hardware.nodes > 1 and cal.hardware.nodes == 1:
        warnings.append(
            "hardware.calibration measured one node: groups across nodes keep the catalog's rates "
            "(calibrate with --nodes 2 or more)"
        )
    elif cal.hardware.nodes != hardware.nodes:
        warnings.append(
            f"hardware.calibration measured {cal.hardware.nodes} nodes, this plan has {hardware.nodes}: rings "
            "across nodes take the nearest measured ring's bandwidth; an all-to-all across nodes is used only "
            "at a measured shape, else the catalog's rate (--explain names each group's source)"
        )
    warnings.extend(f"calibration: {w}" for w in calibration.warning_lines(cal))
    return cal


def plan_model(spec: Spec) -> tuple[ModelPlan, ModelShape, ModelCounts]:
    """The model: preset or local checkpoint, layers truncated; its shape, parameter and FLOP counts."""
    if spec.model.path:
        preset = catalog.model_from_path(spec.model.path)
        weights_path = None  # a config alone: random init from it
        if hf_checkpoint.has_weights(spec.model.path):
            hf_checkpoint.check_checkpoint(spec.model.path)  # a broken checkpoint fails here, not in the job
            weights_path = str(Path(spec.model.path).resolve())
    else:
        preset, weights_path = catalog.model(spec.model.preset or DEFAULT_MODEL), None
    cfg = dict(preset.config)
    layers = ModelShape.from_config(cfg).layers
    if spec.model.num_layers is not None:
        if spec.model.num_layers > layers:
            raise SpecError("model.num_layers", f"{preset.name} has only {layers} layers")
        cfg = dict(cfg, num_hidden_layers=spec.model.num_layers)
    shape = ModelShape.from_config(cfg)
    seq_len = spec.training.seq_len
    if shape.max_positions is not None and seq_len > shape.max_positions:
        raise SpecError(
            "training.seq_len",
            f"{seq_len} exceeds the model's max_position_embeddings ({shape.max_positions})",
        )
    balance = preset.balance or {}
    chosen = plan_balance(spec, preset.name, cfg, float(balance.get("aux_loss_alpha", 0.0)))
    mc = counts(shape, seq_len)
    model = ModelPlan(
        name=preset.name,
        source=preset.source,
        trainable=preset.trainable,
        untrainable_reason=preset.untrainable_reason,
        path=weights_path,
        config=cfg,
        aux_loss_coeff=chosen.aux_loss_coeff,
        seq_aux=bool(balance.get("seq_aux", True)),
        balance=chosen.mode,
        bias_update_speed=chosen.bias_update_speed,
        params_total=mc.total,
        params_active=mc.active,
        flops_per_token=flops_per_token(mc),
    )
    return model, shape, mc


def plan_hardware(spec: Spec, gpu: catalog.GPU, precision: str) -> HardwarePlan:
    nodes, per_node = spec.hardware.nodes, spec.hardware.gpus_per_node
    host_gib, _ = host_memory.node_memory(spec.hardware.host_memory_gib, gpu, per_node)
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
        os.path.abspath(storage.checkpoint_dir) if storage.checkpoint_dir else f"{run_root}/{CHECKPOINTS_DIR}"
    )
    out_dir = os.path.abspath(storage.output_dir) if storage.output_dir else f"{run_root}/{OUTPUTS_DIR}"
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
    """The launch contract every target exports (dskit/launch/contract.py), minus RUN_FILE."""
    per_node = spec.hardware.gpus_per_node
    omp = host_memory.threads_per_rank(spec.hardware.cpus_per_node, per_node, gpu.is_cpu)
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
        Env.OMP_NUM_THREADS.value: str(omp),
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


def build_calibration_plan(spec: Spec, target: str) -> Plan:
    """The plan of `spec` with a calibration job's section (`dskit calibrate TARGET`): the same run.yaml,
    launch contract and targets, and a trainer that measures instead of training."""
    from dskit.calibrate.measures import calibrate_plan, calibration_name

    # its own name, so its storage dirs (and launch-env.json) are not the training run's
    spec = spec.model_copy(update={"name": calibration_name(spec.name, target)})
    plan = build_plan(spec)
    gpu = catalog.gpu(spec.hardware.gpu)
    _, shape, model_counts = plan_model(spec)
    return calibrate_plan(
        plan, shape, model_counts, gpu, resolve_fabric(spec, gpu), spec.hardware.cpus_per_node
    )
