"""`python -m dskit.train`: read the launch contract, build model + engine, train. Nothing else.

`run()` is shared by every launcher: torchrun (this module's `main`) and Ray Train (`dskit.launch.ray_train`,
whose workers arrive with a process group Ray already set up).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from dskit.errors import EXIT_BAD_INPUT, SpecError
from dskit.host import build_locks, extras, jit_ops
from dskit.launch import env_vars
from dskit.launch.contract import (
    LAUNCH_ENV_FILE,
    LAUNCHER_ENV,
    REQUIRED,
    Env,
    collective_timeout_s,
    record_exit,
)
from dskit.refusals import fp8_base_zero_stage, fp8_compute_unsupported, fp8_with_lora

log = logging.getLogger("dskit.train")


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s dskit[rank {rank}] %(levelname)s %(message)s",
        stream=sys.stdout,
        force=True,
    )


def read_contract(*, launcher_env: bool = True):
    """Plan, data, its sampler and the held-out set's sampler (or None) from DSKIT_RUN_FILE; SpecError
    (exit 2) on anything wrong."""
    from dskit.data.sampler import Mixture, Sampler
    from dskit.data.shards import TokenData
    from dskit.plan.schema import load_plan

    run_file = env_vars.read(Env.RUN_FILE.value)
    if not run_file:
        raise SpecError(
            Env.RUN_FILE.value, "not set; launch through a rendered job or `dskit train --local RUN_DIR`"
        )
    plan = load_plan(run_file)
    if plan.finetune is not None and plan.finetune.base_precision == "fp8":
        _check_fp8_base(plan)
    profile = env_vars.read(Env.GPU_PROFILE.value)
    if profile != plan.hardware.gpu:
        raise SpecError(
            Env.GPU_PROFILE.value, f"{profile!r} does not match run.yaml's hardware.gpu {plan.hardware.gpu!r}"
        )
    if launcher_env:
        missing = env_vars.unset(LAUNCHER_ENV)
        if missing:
            raise SpecError("environment", f"{', '.join(missing)} not set: start under torchrun or Ray Train")
        world = env_vars.read("WORLD_SIZE")
        if world != plan.hardware.world_size:
            raise SpecError(
                "WORLD_SIZE",
                f"{world} ranks launched but the plan is for {plan.hardware.world_size} "
                f"({plan.hardware.nodes} nodes x {plan.hardware.procs_per_node})",
            )
    if plan.calibrate is not None:  # a calibration job reads no data (dskit/calibrate/job.py)
        return plan, None, None, None
    vocab = plan.model.config["vocab_size"]
    if plan.run.data_sources:
        parts, samplers = [], []
        for i, (path, _) in enumerate(plan.run.data_sources):
            try:
                parts.append(TokenData.open(path))
                samplers.append(
                    Sampler(parts[-1], plan.parallel.seq_len, plan.run.seed, packing=plan.run.packing)
                )
            except SpecError as e:  # TokenData and Sampler name data.path; here it is one source's
                raise (
                    SpecError(f"data.sources[{i}].path", e.message) if e.field == "data.path" else e
                ) from None
            why = parts[0].same_tokens_as(parts[-1])
            if why:
                raise SpecError(f"data.sources[{i}].path", f"{path} {why}")
        data = parts[0]
        sampler = Mixture(samplers, [w for _, w in plan.run.data_sources], plan.run.seed)
    else:
        data = TokenData.open(plan.run.data_path)
        sampler = Sampler(data, plan.parallel.seq_len, plan.run.seed, packing=plan.run.packing)
    if data.vocab_size > vocab:
        raise SpecError(
            "data.sources[0].path" if plan.run.data_sources else "data.path",
            f"tokenizer vocabulary {data.vocab_size} exceeds the model's vocab_size {vocab}",
        )
    return plan, data, sampler, _eval_sampler(plan, data)


def _check_fp8_compute(plan, device) -> None:
    """training.fp8 re-checked where the run landed (a run.yaml moved or edited since the plan)."""
    from dskit.train.fp8 import compute

    extras.require("training.fp8", "fp8")
    why = compute.device_unmet(device)
    if why:
        raise fp8_compute_unsupported(compute.device_name(device), why)
    if plan.finetune is not None:
        raise fp8_with_lora()
    if plan.parallel.precision != "bf16":
        raise SpecError(
            "training.fp8", f"runs over bf16 weights; this run.yaml's precision is {plan.parallel.precision}"
        )


def _check_fp8_base(plan) -> None:
    """An fp8 base trains from model.path's FP8 checkpoint under ZeRO-1/2 (dskit/train/fp8/frozen_base.py);
    the plan checks both, and run.yaml or the checkpoint may have changed since."""
    from dskit.train.fp8.frozen_base import checkpoint_format

    checkpoint_format(plan.model.path)  # the FP8 weights themselves, not a config.json that plans them
    if plan.deepspeed["zero_optimization"]["stage"] == 3:
        raise fp8_base_zero_stage(3)


def _eval_sampler(plan, data):
    """The held-out set: data.eval_path, or DATA/eval written by `data prepare --eval-fraction`."""
    from dskit.data.sampler import Sampler
    from dskit.data.shards import EVAL_DIR, TokenData

    path, field = plan.run.eval_path, "data.eval_path"
    if path is None and plan.run.data_path and Path(plan.run.data_path, EVAL_DIR, "index.json").is_file():
        path, field = str(Path(plan.run.data_path, EVAL_DIR)), "data.path"
    if path is None:
        return None
    try:
        held = TokenData.open(path)
        why = data.same_tokens_as(held)
        if why:
            raise SpecError(field, f"{path} {why}")
        sampler = Sampler(held, plan.parallel.seq_len, plan.run.seed, packing=plan.run.packing)
        need = plan.hardware.world_size * plan.parallel.micro_batch
        if sampler.windows < need:  # checked before the model is built, not at the first eval
            raise SpecError(
                field,
                f"{path} holds {sampler.windows} eval samples of {plan.parallel.seq_len} tokens, fewer than one "
                f"micro-batch on every rank ({need}); hold out more (data prepare --eval-fraction)",
            )
        return sampler
    except SpecError as e:  # TokenData names data.path; here the field is the eval set's
        raise SpecError(field, e.message) if e.field == "data.path" else e from None


def run(plan, data, sampler, eval_sampler=None, *, reporter: Callable[[dict], None] | None = None) -> int:
    """Build model + engine and train (a calibration job measures instead: dskit/calibrate/job.py).
    The caller owns the process group's lifetime."""
    import warnings

    if plan.calibrate is not None:
        from dskit.calibrate.job import calibrate

        return calibrate(plan, *start_distributed(plan))

    # DeepSpeed calls torch's deprecated collective names on every step; one line each, per rank.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    from dskit.train.balance import RouterTap
    from dskit.train.loop import train
    from dskit.train.watchdog import Watchdog

    device, rank, world = start_distributed(plan)
    log.info("data: %s", sampler.describe())
    if sampler.truncated:
        log.warning(
            "data: %d samples are longer than seq_len+1 (%d tokens) and are cut to it",
            sampler.truncated,
            plan.parallel.seq_len + 1,
        )
    engine = build_engine(plan, device, rank=rank)
    score = "sigmoid" if plan.model.config["model_type"] == "deepseek_v3" else "softmax"
    tap = RouterTap(
        engine.module,
        score_func=score,
        top_k=plan.model.config["num_experts_per_tok"],
        bias_update_speed=plan.model.bias_update_speed,
    )
    if eval_sampler is not None:
        log.info("eval: %s, every %d steps and at the end", eval_sampler.data.source, plan.run.eval_every)
    # armed once the engine is built: construction's long phases (JIT builds, weight loading) are bounded
    # by the collective timeout alone
    with Watchdog(plan.run.watchdog_timeout_s, plan.run.output_dir, rank) as dog:
        return train(
            plan,
            engine,
            tap,
            sampler,
            eval_sampler,
            rank=rank,
            world=world,
            device=device,
            watchdog=dog,
            reporter=reporter,
        )


def start_distributed(plan):
    """(device, rank, world) once the process group is up; rank 0 records the launch env it saw."""
    jit_ops.use_own_builds()  # before DeepSpeed loads its first compiled op (shm_comm on CPU ranks)
    local_rank = env_vars.read("LOCAL_RANK") or 0
    if local_rank == 0:  # once a host: DeepSpeed's start may wait on one forever
        for lock in build_locks.orphaned():
            log.warning("%s", build_locks.warning(lock))
    import deepspeed
    import torch
    import torch.distributed as dist

    on_gpu = plan.hardware.on_gpu
    if on_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # the watchdog's timeout bounds every collective too: a wedged communicator errors instead of hanging
    timeout = timedelta(seconds=collective_timeout_s(plan.run.watchdog_timeout_s))
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    # one line per rank, so a multi-node log shows which hosts took part
    print(f"dskit: rank {rank} of {world} on {socket.gethostname()}", flush=True)
    if rank == 0:
        names = [*REQUIRED, *(k for k in plan.env if k not in REQUIRED)]
        Path(plan.run.output_dir).mkdir(parents=True, exist_ok=True)
        Path(plan.run.output_dir, LAUNCH_ENV_FILE).write_text(
            json.dumps(env_vars.recorded(names), indent=1, sort_keys=True)
        )
    return device, rank, world


def build_engine(plan, device, *, rank: int, deepspeed_config: dict | None = None):
    """The DeepSpeed engine for the plan (ZeRO-3: its model partitioned from the first parameter on). Records
    what each rank holds and its memory peaks (`construction-rankN.json`). `deepspeed_config` replaces
    the plan's only for benchmarks that measure construction without an optimizer."""

    from dskit.train.metrics import memory_gib
    from dskit.train.model import apply_sdpa_policy, build_model, resolve_attention, torch_dtype

    ds_config = plan.deepspeed if deepspeed_config is None else deepspeed_config
    attention, why = resolve_attention(plan.parallel.attention, device)
    apply_sdpa_policy(attention)
    log.info("plan: %s", plan.summary())
    log.info("attention: %s (%s)", attention, why)
    if plan.parallel.fp8:  # before minutes of building: the device the run landed on, the extra, LoRA
        from dskit.train.fp8 import compute

        _check_fp8_compute(plan, device)
    t0 = time.perf_counter()
    # the adapters' base layers are the FP8 ones, built before peft wraps them
    fp8_base = plan.finetune is not None and plan.finetune.base_precision == "fp8"
    model = build_model(
        plan.model,
        attention=attention,
        dtype=torch_dtype(plan.parallel.precision),
        seed=plan.run.seed,
        ckpt_every=plan.parallel.activation_checkpointing,
        deepspeed_config=ds_config,
        loss_chunk_tokens=plan.parallel.loss_chunk_tokens,
        device=device,
        fp8_base=fp8_base,
    )
    fp8 = None
    if plan.parallel.fp8:  # before ZeRO hooks the modules
        fp8 = compute.convert_linears(model, plan.parallel.fp8, plan.parallel.fp8_linears)
        missing = set(plan.parallel.fp8_linears) - {compute.role(n) for n in fp8.linears}
        if missing:  # the plan names roles from the model's config: a mismatch is a run.yaml edited by hand
            raise SpecError(
                "parallel.fp8_linears", f"{sorted(missing)}: no bias-free linear of the model has them"
            )
    params = model.parameters()
    if plan.finetune is not None:
        from dskit.train.lora.inject import attach

        attach(model, plan.finetune, seed=plan.run.seed, dtype=torch_dtype(plan.parallel.precision))
        # lazy: the engine reads it after AutoEP's replacements (and the routed experts' adapters,
        # attached then: _initialize); frozen weights get no optimizer state
        params = (p for p in model.parameters() if p.requires_grad)
    built = {
        "build_s": round(time.perf_counter() - t0, 2),
        "build_peak_alloc_gib": round(memory_gib(device)[0], 3),
    }
    stage = ds_config["zero_optimization"]["stage"]  # what build_model read (a benchmark may pass its own)
    how = "under ZeRO-3 partitioning" if stage == 3 else f"whole on {device} (ZeRO-{stage})"
    log.info("model built %s in %.1f s; starting the engine", how, built["build_s"])
    with contextlib.ExitStack() as stack:
        if fp8_base:  # AutoEP's replacement happens inside deepspeed.initialize, before the optimizer
            from dskit.train.fp8.frozen_base import experts_stay_fp8

            fp8_experts = stack.enter_context(experts_stay_fp8(plan.model.path, device))
        engine = _initialize(plan, model, params, ds_config, stage, fused=deepspeed_config is None)
    if fp8_base:
        from dskit.train.fp8.frozen_base import check_filled

        check_filled(engine.module, fp8_experts)
        log.info(
            "fp8 base: this rank's routed experts of %d MoE layers kept in FP8 (%.3f GiB)",
            len(fp8_experts),
            sum(fp8_experts.values()) / 2**30,
        )
    if fp8 is not None:
        if plan.parallel.fp8_experts:  # AutoEP's experts exist only now, inside the engine
            fp8.expert_layers = compute.convert_experts(engine.module)
        log.info(
            "fp8 %s: %d linears (%s) and the routed experts of %d MoE layers compute in FP8; the rest bf16",
            fp8.recipe,
            len(fp8.linears),
            ", ".join(plan.parallel.fp8_linears) or "none",
            fp8.expert_layers,
        )
    compiled: dict[str, int] = {}
    if plan.parallel.compile_regions:  # after AutoEP has replaced the MoE blocks: what remains is routed
        from dskit.train.compile import compile_regions

        compiled = compile_regions(
            engine.module, attention=plan.parallel.compile_attention, cuda_graphs=plan.parallel.cuda_graphs
        )
    from dskit.train import fused_step

    # what ran, beside what the plan asked: benchmarks refuse a row whose kernels fell back
    built["ran"] = {
        "attention": attention,
        "compiled": compiled,
        "optimizer_step": "fused" if fused_step.installed(engine) else "deepspeed",  # installed, not asked
        "gradients": fused_step.gradients(engine),
        "grad_first_write": fused_step.grad_first_write(engine),
        # AutoEP's top-k combine in its layers (resolved: "weighted_sum" or "fused_weighted_sum")
        "fp8": fp8.as_record() if fp8 is not None else None,
        "moe_combine": sorted(
            {m.combine_impl for m in engine.module.modules() if hasattr(m, "combine_impl")}
        ),
    }
    adapters = plan.finetune.adapter_params if plan.finetune else 0
    _record_construction(engine, plan.model.params_total + adapters, rank, device, plan.run.output_dir, built)
    return engine


def check_gradients(parallel) -> None:
    """What a hand-edited run.yaml may not combine (the plan never writes these): flat gradients without
    the fused step, or a `copy` landing for gradients that do not go flat (it would be ignored)."""
    if parallel.gradients == "flat" and parallel.optimizer_step != "fused":
        raise SpecError("parallel.gradients", "flat runs only with the fused step under ZeRO-1/2; re-render")
    if parallel.grad_first_write == "copy" and parallel.gradients != "flat":
        raise SpecError(
            "parallel.grad_first_write",
            "copy lands flat gradients only (parallel.gradients: flat); re-render",
        )


def _initialize(plan, model, params, ds_config: dict, stage: int, *, fused: bool):
    """deepspeed.initialize, with the plan's optimizer step (torch's fused AdamW inside ZeRO-1/2:
    dskit/train/fused_step.py) and, for LoRA, the routed experts' adapters attached right after AutoEP's
    replacement (dskit/train/lora/routed.py) and, under ZeRO-1/2, DeepSpeed's MoE-group check relaxed."""
    import deepspeed

    check_gradients(plan.parallel)

    with contextlib.ExitStack() as stack:
        if plan.finetune is not None and stage != 3:
            from dskit.train.lora.inject import frozen_experts_allowed

            stack.enter_context(frozen_experts_allowed())
        if plan.finetune is not None and plan.finetune.routed_adapter_params:
            from dskit.train.lora.routed import after_autoep
            from dskit.train.model import torch_dtype

            dtype = torch_dtype(plan.parallel.precision)
            stack.enter_context(after_autoep(plan.finetune, seed=plan.run.seed, dtype=dtype))
        if not (fused and plan.parallel.optimizer_step == "fused"):
            return deepspeed.initialize(model=model, model_parameters=params, config=ds_config)[0]
        from dskit.train import fused_step

        opt = ds_config["optimizer"]
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=params,
            optimizer=lambda ps: fused_step.adamw(ps, opt),  # called after AutoEP's replacement
            config={k: v for k, v in ds_config.items() if k != "optimizer"},
        )
        try:
            fused_step.install(
                engine.optimizer,
                flat=plan.parallel.gradients == "flat",
                first_write=plan.parallel.grad_first_write,
            )
        except fused_step.Refused as e:  # bad input (run.yaml edited by hand): one line, exit 2
            raise SpecError(e.field, str(e)) from None
        return engine


CONSTRUCTION_FILE = "construction-rank{rank}.json"  # what each rank held once the model was built


def _record_construction(engine, params_total: int, rank: int, device, output_dir: str, built: dict) -> None:
    """Measured, per rank: parameter elements held locally against the model's total, and memory at the
    end of construction. Tests compare the share with 1/world; the plan's construction estimate is
    checked against the peaks on GPUs (bench/)."""
    from dskit.train.fp8.blocks import Fp8Linear
    from dskit.train.fp8.frozen_base import held_bytes
    from dskit.train.metrics import current_gib, memory_gib

    # Each element of the model is stored on exactly one rank of a full ZeRO-3 + AutoEP run, so the
    # ranks' local counts add up to the model's parameter count and each is about 1/world of it; under
    # ZeRO-1/2 a rank holds every non-expert weight and its 1/ep of the experts.
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.parameters())
    # an FP8 base's linears hold their weights as buffers (dskit/train/fp8/blocks.py): still the model's elements
    local += sum(m.weight.numel() for m in engine.module.modules() if isinstance(m, Fp8Linear))
    total = params_total
    alloc, reserved = memory_gib(device)
    rec = {
        "rank": rank,
        **built,
        "params_local": local,
        "params_model": total,
        "peak_alloc_gib": round(alloc, 3),
        "peak_reserved_gib": round(reserved, 3),
        "host_rss_gib": round(current_gib(device)["host"], 3),
        # the frozen base by dtype (float8_e4m3fn for an fp8 base's weights, float32 for its scales)
        "frozen_bytes": held_bytes(engine.module),
    }
    Path(output_dir, CONSTRUCTION_FILE.format(rank=rank)).write_text(json.dumps(rec) + "\n")
    log.info(
        "built and partitioned: %d of %d parameter elements on this rank; peak %.2f GiB allocated, "
        "%.2f GiB reserved; host RSS %.2f GiB",
        local,
        total,
        alloc,
        reserved,
        rec["host_rss_gib"],
    )


def _error_line(e: Exception) -> None:
    # One write per line: ranks share the launcher's stderr, and print() may split text and newline.
    sys.stderr.write(f"dskit: error: {e}\n")
    sys.stderr.flush()


def main() -> int:
    # The code is recorded before the process group is torn down: tearing it down ends the peers'
    # collectives, and the launcher kills a rank that has not finished once a peer exits.
    try:
        code = _main()
    except BaseException:
        # a crash is a failure the launcher must not mistake for a requeue: its peers may exit 75
        record_exit(1)
        _destroy_process_group()
        raise
    if code == FOLLOWED_A_PEER:
        code = 1  # torchrun's status; the verdict is the peer's, so nothing is recorded
    else:
        record_exit(code)
    _destroy_process_group()
    return code


#: _main's code for a rank whose collective failed because a peer ended first (exited, was killed):
#: the peer's own recorded code (75, 74, 2, a crash's 1) or its silence (killed) decides the verdict,
#: and this rank adds none, so a peer's requeue is not turned into a failure by the ranks it left.
FOLLOWED_A_PEER = -1


def _destroy_process_group() -> None:
    # Without this a rank may abort at exit (torch warns of a leaked process group and gloo/NCCL
    # teardown can race the interpreter's).
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _main() -> int:
    try:
        setup_logging(env_vars.read("RANK") or 0)
        plan, data, sampler, eval_sampler = read_contract()
    except SpecError as e:
        _error_line(e)
        return EXIT_BAD_INPUT
    jit_ops.import_deepspeed(mlflow=plan.tracking is not None and plan.tracking.mlflow is not None)
    from dskit.train.checkpoints.reshard import ConversionFailed
    from dskit.train.checkpoints.store import DiskFull

    try:
        return run(plan, data, sampler, eval_sampler)
    except SpecError as e:
        _error_line(e)
        return EXIT_BAD_INPUT
    except DiskFull as e:
        _error_line(e)
        return e.code
    except ConversionFailed as e:  # rank 0 says 1; a waiting rank leaves the verdict to rank 0's code
        _error_line(e)
        return FOLLOWED_A_PEER if e.code is None else e.code
    except RuntimeError as e:  # DistError is one
        if not collective_failed(e):
            raise
        # A collective lost its peer (that rank's own exit code decides whether to retry) or timed
        # out where the watchdog could not fire (it fires first, and decides restarts): a failure.
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        rank = env_vars.read("RANK")  # parsed at the start already
        rank = "?" if rank is None else rank
        if "Timed out" in first or "timed out" in first:
            _error_line(Exception(f"rank {rank}: a collective timed out ({first[:240]}): a rank hangs"))
            return 1
        _error_line(Exception(f"rank {rank}: a collective failed ({first[:240]}): another rank ended first"))
        return FOLLOWED_A_PEER


#: what torch's gloo and NCCL backends say when a peer is gone or a collective timed out
_COLLECTIVE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "Timed out")


def collective_failed(e: BaseException) -> bool:
    """A collective's error (torch's DistError, or gloo's RuntimeError from a wait) rather than a bug."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    tb, deepest = e.__traceback__, ""
    while tb is not None:  # the frame that raised: torch's or DeepSpeed's communication, not ours
        deepest, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    in_lib = "/torch/" in deepest or "/deepspeed/" in deepest
    return in_lib and any(sign in str(e) for sign in _COLLECTIVE_SIGNS)
