"""The plan's parallel section: how the global batch splits over the ranks, and the fastest candidate
that fits (ZeRO stage, EP size, micro-batch, activation checkpointing, optimizer offload;
`dskit/plan/search.py` holds the candidates and the ranking), with the loss chunk, regional compile and
attention backend that go with it.

The spec's overrides pin dimensions of the search here (`_pinned`); a pinned value the search cannot
take is refused with the values it can (one line, exit 2).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dskit import catalog
from dskit.calibrate import scales
from dskit.calibrate.calibration import Calibration
from dskit.errors import SpecError, one_of
from dskit.plan import fit, fp8_training, host_memory, links, memory, search, speed
from dskit.plan.adapters import Tuning
from dskit.plan.candidate import Candidate, Cluster, Fp8Compute, Workload
from dskit.plan.model_math import ModelCounts
from dskit.plan.schema import HardwarePlan, ModelPlan, ParallelPlan
from dskit.plan.shape import ModelShape
from dskit.refusals import fp8_base_zero_stage, fp8_with_lora
from dskit.spec import PlanOverrides, Spec

#: the default global batch: 256 sequences (~1M tokens at seq 4096, the seed post's batch) ...
DEFAULT_GLOBAL_BATCH = 256
#: ... or this many per GPU where that is more (clusters of more than 64 GPUs): one sequence per GPU
#: would leave ZeRO's per-micro-step collectives and the per-layer costs unamortised. DeepSeek trained V2
#: with 2304-9216 sequences per step and V3 with 3072-15360 (the V2 and V3 reports); 4 per GPU is 1024
#: at 256 GPUs and 4096 at 1024.
DEFAULT_SEQUENCES_PER_GPU = 4


@dataclass(frozen=True)
class Trained:
    """The model the search plans for: its plan section, its shape and counts, a LoRA run's tuning."""

    plan: ModelPlan
    shape: ModelShape
    counts: ModelCounts
    tuning: Tuning | None = None  # None: full fine-tuning


@dataclass(frozen=True)
class Hardware:
    """What the search runs on: the catalog's GPU and fabric, the plan's hardware section at its
    precision, and what `dskit calibrate` measured on this cluster (None: the catalogs' rates)."""

    gpu: catalog.GPU
    fabric: catalog.Fabric
    plan: HardwarePlan
    precision: str
    calibration: Calibration | None = None


def plan_parallel(
    spec: Spec, model: Trained, hw: Hardware, warnings: list[str]
) -> tuple[ParallelPlan, search.Search]:
    """EP size and batch split, checkpointing and offload: the fastest candidate that fits
    (`dskit/plan/search.py`), and the attention backend. A LoRA run (`model.tuning`) is searched alike."""
    gpu, precision, calibration = hw.gpu, hw.precision, hw.calibration
    world, per_node = hw.plan.world_size, hw.plan.procs_per_node
    if spec.overrides.ep_size is not None:  # checked here: one line naming the valid sizes
        _check_pinned_ep(model.shape.routed_experts, world, per_node, spec.overrides.ep_size)
    gb, per_rank = _batch_split(spec, world)
    cuda_graphs(spec, gpu)  # `on` where no candidate could take graphs: refused before the search
    compiled = _compiled(spec, gpu, warnings)
    seq_len = spec.training.seq_len
    attention = attention_compile(spec.overrides.compile, gpu)
    fp8 = _fp8(spec, model.shape, hw, warnings)
    setting = _setting(
        spec,
        model,
        hw,
        per_rank,
        compiled=compiled,
        compiled_attention=attention,
        fp8=_fp8_compute(fp8, model.shape),
    )
    speed_of = _speed_of(setting, hw)
    # CPU ranks have a step time only where a calibration measured their compute rate (speed._cpu_step)
    weighs = not gpu.is_cpu or bool(calibration is not None and calibration.compute.gemm_tflops)
    found = _search(spec.overrides, setting, per_rank, speed_of, hw.fabric.name, warnings, weighs=weighs)
    c = found.chosen.candidate
    found = dataclasses.replace(
        found, calibration=calibration, precision_alternative=_precision_alternative(fp8, setting, hw, c)
    )
    _warn_over_the_margin_only(found, warnings)
    step = optimizer_step(spec.overrides.optimizer_step, c.zero_stage, c.offload, warnings)
    compile_attention = attention and c.zero_stage < 3
    flat = memory.flat_gradients(world, c.zero_stage, c.offload, step == "fused", precision)
    # grad_first_write stays "add": "copy" did not win on one H100 (bench/JOURNAL.md, "Host syncs by line")
    parallel = ParallelPlan(
        zero_stage=c.zero_stage,
        ep_size=c.ep_size,
        expert_dp_size=world // c.ep_size,
        micro_batch=c.micro_batch,
        grad_accum=setting.grad_accum(c),
        global_batch=gb,
        seq_len=seq_len,
        activation_checkpointing=c.ckpt_every,
        precision=precision,
        attention=_attention(spec, gpu),
        offload_optimizer=c.offload,
        loss_chunk_tokens=memory.loss_chunk_for(model.shape, c.micro_batch * seq_len, spec.overrides.loss),
        compile_regions=compiled,
        compile_attention=compile_attention,
        cuda_graphs=cuda_graphs(spec, gpu, compile_attention, c.ckpt_every),
        optimizer_step=step,
        gradients="flat" if flat else "buckets",
        **fp8,
    )
    return parallel, found


def _warn_over_the_margin_only(found: search.Search, warnings: list[str]) -> None:
    """A much faster plan left out only by the memory margin is named, with the margin that takes it: the
    estimate is mostly high (docs/planner.md), and the pick it leaves (often an offloaded optimizer) can
    be many times slower."""
    near = search.over_the_margin_only(found.rows, found.chosen)
    if near is None:
        return
    s = near.fit.setting
    margin = math.floor(100 * (1 - near.fit.peak_gib / s.gpu.usable_memory_gib)) / 100  # type: ignore[operator]
    ratio = near.speed.tokens_per_s / found.chosen.speed.tokens_per_s  # type: ignore[union-attr]
    warnings.append(
        f"{near.candidate.describe()} is predicted {ratio:.1f}x this plan's tokens/s, but its "
        f"{near.fit.peak_gib:.1f} GiB per GPU is over {fit.gpu_limit_text(s)}; overrides.gpu_memory_margin="
        f"{margin:.2f} lets it fit, at the risk of running out of GPU memory"
    )


def _fp8(spec: Spec, shape: ModelShape, hw: Hardware, warnings: list[str]) -> dict[str, Any]:
    """ParallelPlan's FP8 fields: the recipe, the linears that pay, the experts (dskit/plan/fp8_training.py)."""
    recipe = fp8_training.recipe(spec.training.fp8, hw.gpu, hw.precision)
    if recipe is None:
        if spec.overrides.fp8_experts == "on":
            warnings.append(
                "overrides.fp8_experts=on does nothing without training.fp8: the run computes in bf16"
            )
        return {}
    if spec.finetune.method != "full":
        raise fp8_with_lora()
    roles = fp8_training.linear_roles(shape, recipe)
    experts = fp8_training.experts(spec.overrides.fp8_experts, shape)
    if not roles and not experts:
        warnings.append(
            f"training.fp8: no linear of this model is large enough to run faster in FP8 {recipe} (the smallest "
            f"measured to: {fp8_training.MIN_ELEMENTS[recipe]:,} weights) and its experts stay bf16: it computes "
            "in bf16"
        )
    return {"fp8": recipe, "fp8_linears": roles, "fp8_experts": experts}


def _fp8_compute(fields: dict[str, Any], shape: ModelShape) -> Fp8Compute | None:
    if not fields:
        return None
    return fp8_training.compute(fields["fp8"], fields["fp8_linears"], fields["fp8_experts"], shape)


def _precision_alternative(
    fields: dict[str, Any], setting: fit.Setting, hw: Hardware, chosen: Candidate
) -> tuple[str, speed.StepTime | None] | None:
    """The chosen candidate's step time with the other choice of `training.fp8` (`--explain` shows both):
    bf16 beside a planned FP8, or what `on` would give beside bf16 where the GPU has FP8."""
    if fields:
        other, work = "bf16", dataclasses.replace(setting.work, fp8=None)
    elif fp8_training.unmet(hw.gpu) is None and hw.precision == "bf16":
        shape = setting.work.shape
        recipe = fp8_training.FASTEST
        roles = fp8_training.linear_roles(shape, recipe)
        fp8 = fp8_training.compute(recipe, roles, fp8_training.EXPERTS_FASTER, shape)
        other = f"training.fp8=on ({recipe} on {', '.join(roles) or 'no linear: none is large enough'})"
        work = dataclasses.replace(setting.work, fp8=fp8)
    else:
        return None
    return other, _speed_of(dataclasses.replace(setting, work=work), hw)(chosen)


def speed_section(found: search.Search) -> dict[str, Any] | None:
    """The plan's `speed`: the winner's predicted step time; with overrides that cost speed, the cost."""
    if not found.chosen.speed:
        return None
    d = found.chosen.speed.as_dict()
    cost = found.forced_cost
    if cost is not None and cost > search.SPEED_TIE:
        d["overrides_cost"] = round(cost, 3)  # predicted share of tokens/s given up to the overrides
    return d


def global_batch(given: int | None, world: int) -> int:
    """`training.global_batch`, or the default: DEFAULT_GLOBAL_BATCH or DEFAULT_SEQUENCES_PER_GPU x the
    world size, whichever is larger, rounded up to a multiple of the world size."""
    if given is not None:
        return given
    want = max(DEFAULT_GLOBAL_BATCH, DEFAULT_SEQUENCES_PER_GPU * world)
    return -(-want // world) * world


def optimizer_step(choice: str, zero_stage: int, offload: bool, warnings: list[str]) -> str:
    """`overrides.optimizer_step` -> the trainer's step. torch's fused AdamW replaces DeepSpeed's
    optimizer inside ZeRO-1/2 only: ZeRO-3's step and the CPU optimizer of offload are DeepSpeed's own."""
    applies = zero_stage in (1, 2) and not offload
    if choice == "fused" and not applies:
        where = "optimizer offload" if offload else f"ZeRO-{zero_stage}"
        warnings.append(
            f"overrides.optimizer_step=fused applies to ZeRO-1/2 without offload; this plan's {where} keeps "
            "DeepSpeed's step"
        )
    return "fused" if choice != "deepspeed" and applies else "deepspeed"


def regional_compile(choice: str, gpu: catalog.GPU) -> bool:
    """`overrides.compile` -> whether the trainer compiles its regions. auto: on GPUs, where it measured
    faster and smaller (bench/README.md); off on the cpu profile, whose runs are tests and short: there
    inductor's C++ compile takes longer than it saves."""
    return choice in ("on", "regions") or (choice == "auto" and not gpu.is_cpu)


def attention_compile(choice: str, gpu: catalog.GPU) -> bool:
    """`overrides.compile` -> whether whole attention blocks are compiled where the ZeRO stage allows it
    (1 and 2: no module hooks inside them). `regions` leaves them eager."""
    return choice == "on" or (choice == "auto" and not gpu.is_cpu)


#: what `overrides.cuda_graphs: auto` decides where graphs apply: measured slower on one H100 (0.86-0.98x,
#: bench/peer_bench.py --host-bound --lever overrides.cuda_graphs=on; docs/plan.md "CUDA graphs")
CUDA_GRAPHS_FASTER = False


def cuda_graphs(
    spec: Spec, gpu: catalog.GPU, compiled_attention: bool | None = None, ckpt_every: int = 0
) -> bool:
    """`overrides.cuda_graphs` -> whether the compiled attention blocks replay as CUDA graphs. A graph
    replays fixed shapes, so only rows of one shape (packed text) qualify; activation checkpointing's
    recompute frees inputs a recorded graph still points to (torch's cudagraph trees refuse it). `on`
    where they cannot apply is refused in one line saying what is missing; called before the search
    (`compiled_attention` None) for what does not depend on the candidate, where `on` also narrows the
    search to ZeRO-1/2 without checkpointing (`_pinned`), and after it for the candidate."""
    missing = _graphs_missing(spec, gpu, compiled_attention, ckpt_every)
    if spec.overrides.cuda_graphs == "on" and missing:
        raise SpecError("overrides.cuda_graphs", f"on needs {missing}; allowed here: auto, off")
    return missing is None and (
        spec.overrides.cuda_graphs == "on" or (spec.overrides.cuda_graphs == "auto" and CUDA_GRAPHS_FASTER)
    )


def _graphs_missing(
    spec: Spec, gpu: catalog.GPU, compiled_attention: bool | None, ckpt_every: int
) -> str | None:
    if gpu.is_cpu:
        return "a GPU"
    if spec.overrides.compile in ("off", "regions"):
        return "compiled attention blocks (overrides.compile: on or auto)"
    if spec.data.packing == "pad":
        return "rows of one shape (data.packing: pack)"
    if compiled_attention is False:
        return "ZeRO-1/2, whose attention blocks are compiled whole (overrides.zero_stage: 1 or 2)"
    if ckpt_every:
        return "no activation checkpointing (overrides.activation_checkpointing: 0)"
    return None


def _check_pinned_ep(n_experts: int, world: int, per_node: int, ep: int) -> None:
    if search.ep_divides(n_experts, world, ep) and not search.ep_tiles_nodes(ep, min(per_node, world)):
        valid = ", ".join(str(d) for d in sorted(search.ep_sizes(n_experts, world, per_node)))
        raise SpecError(
            "overrides.ep_size",
            f"{ep} must divide the ranks per node ({per_node}) or be a multiple of it, so that AutoEP's groups "
            f"of consecutive ranks do not straddle nodes unevenly; valid: {valid}",
        )
    if not search.ep_divides(n_experts, world, ep):
        valid = ", ".join(str(d) for d in sorted(search.ep_sizes(n_experts, world, per_node)))
        raise SpecError(
            "overrides.ep_size",
            f"{ep} must divide both the expert count ({n_experts}) and the world size ({world}); valid: {valid}",
        )


def _batch_split(spec: Spec, world: int) -> tuple[int, int]:
    """(global batch, per-rank batch), or the refusal of a global batch or pinned micro-batch that does
    not split into whole micro-steps."""
    gb = global_batch(spec.training.global_batch, world)
    if gb % world:
        lo, hi = (gb // world) * world, (gb // world + 1) * world
        nearest = ", ".join(str(x) for x in dict.fromkeys((lo or hi, hi)))
        raise SpecError(
            "training.global_batch",
            f"{gb} is not divisible by the world size {world}; nearest: {nearest}",
        )
    per_rank = gb // world
    mb = spec.overrides.micro_batch
    if mb is not None and not search.micro_batch_splits(per_rank, mb):
        raise SpecError(
            "overrides.micro_batch",
            f"{mb} does not divide the per-rank batch {per_rank} "
            f"(global_batch {gb} / world {world}); valid: {search.valid_micro_batches(per_rank)}",
        )
    return gb, per_rank


def _compiled(spec: Spec, gpu: catalog.GPU, warnings: list[str]) -> bool:
    compiled = regional_compile(spec.overrides.compile, gpu)
    if compiled and gpu.is_cpu:
        warnings.append(
            "overrides.compile=on on the cpu profile: inductor builds C++ at the first step, which needs a C++ "
            "compiler (dskit's CPU image has none) and takes longer than short runs save"
        )
    return compiled


def _setting(
    spec: Spec,
    model: Trained,
    hw: Hardware,
    per_rank: int,
    *,
    compiled: bool,
    compiled_attention: bool,
    fp8: Fp8Compute | None = None,
) -> fit.Setting:
    """What every candidate's fit and speed depend on besides the candidate."""
    per_node = hw.plan.procs_per_node
    host_gib, host_from = host_memory.node_memory(spec.hardware.host_memory_gib, hw.gpu, per_node)
    work = Workload(
        shape=model.shape,
        counts=model.counts,
        flops_per_token=model.plan.flops_per_token,
        seq_len=spec.training.seq_len,
        per_rank=per_rank,
        tuning=model.tuning,
        precision=hw.precision,
        compiled=compiled,
        compiled_attention=compiled_attention,
        fused_step=spec.overrides.optimizer_step != "deepspeed",
        loss=spec.overrides.loss,
        fp8=fp8,
    )
    # an offloaded optimizer steps on the rank's OMP_NUM_THREADS cores (hardware.cpus_per_node)
    threads = host_memory.threads_per_rank(spec.hardware.cpus_per_node, per_node, hw.gpu.is_cpu)
    cluster = Cluster(
        gpu=hw.gpu,
        world=hw.plan.world_size,
        per_node=per_node,
        peak_tflops=hw.plan.peak_tflops,
        host_threads=threads,
    )
    return fit.Setting(
        model=model.plan.name,
        work=work,
        cluster=cluster,
        host_memory_gib=host_gib,
        host_memory_from=host_from,
        loads_weights=model.plan.path is not None,
        gpu_margin=fit.GPU_MEMORY_MARGIN
        if spec.overrides.gpu_memory_margin is None
        else spec.overrides.gpu_memory_margin,
    )


def _speed_of(setting: fit.Setting, hw: Hardware) -> search.SpeedOf:
    """A candidate's predicted step time on this hardware (`dskit/plan/speed.py`), at the collective
    rates and fitted terms' factors of its calibration, where it has one."""
    rates = links.Links.of(hw.gpu, hw.fabric, hw.calibration)
    factors = scales.factors(hw.calibration, scales.kind_of(hw.gpu.name))

    def speed_of(c: Candidate) -> speed.StepTime | None:
        return speed.predict(setting.work, c, setting.cluster, rates, factors)

    return speed_of


def _search(
    o: PlanOverrides,
    setting: fit.Setting,
    per_rank: int,
    speed_of: search.SpeedOf,
    fabric_name: str,
    warnings: list[str],
    *,
    weighs: bool = True,
) -> search.Search:
    """The fastest candidate that fits, else SpecError (exit 2). The candidates are `search.axes`';
    overrides pin dimensions of them, and the planner's own pick is still ranked, so a slower forced
    choice is named in a warning."""
    free = search.axes(setting, per_rank, weighs=weighs)
    if (
        o.zero_stage is not None
        and o.zero_stage not in search.FP8_BASE_STAGES
        and setting.tuning
        and setting.tuning.fp8
    ):
        raise fp8_base_zero_stage(o.zero_stage)
    pinned, forced = _pinned(o, free)
    found = search.search(
        setting,
        pinned,
        free=free,
        forced=forced,
        speed_of=speed_of,
        ep_for=_ep_at(setting.work.shape.routed_experts, setting.per_node, o.ep_size),
    )
    warnings.extend(_search_warnings(found, o, forced, fabric_name))
    return found


def _pinned(o: PlanOverrides, free: search.Axes) -> tuple[search.Axes, list[str]]:
    """The search's dimensions with the overrides' values pinned, and the overrides' keys that pin one."""
    if o.zero_stage is not None and not search.offload_with(o.zero_stage) and o.offload_optimizer == "cpu":
        raise SpecError(
            "overrides.offload_optimizer",
            f"cpu is searched with ZeRO-3 only, and overrides.zero_stage is {o.zero_stage}; "
            "one of: auto, none (or overrides.zero_stage 3)",
        )

    def one(value: Any) -> tuple | None:
        return None if value is None else (value,)

    pins = {  # axis: (spec key, its pinned values or None), in the order a refusal names them
        "offloads": (
            "overrides.offload_optimizer",
            {"none": (False,), "cpu": (True,)}.get(o.offload_optimizer),
        ),
        "eps": ("overrides.ep_size", one(o.ep_size)),
        "micro_batches": ("overrides.micro_batch", one(o.micro_batch)),
        "ckpts": ("overrides.activation_checkpointing", one(o.activation_checkpointing)),
        # last: the refusal names forced[0], and a stage rarely is what does not fit
        "stages": ("overrides.zero_stage", one(o.zero_stage)),
    }
    if o.cuda_graphs == "on":  # what a graph needs, where the user pinned nothing else (cuda_graphs())
        if o.activation_checkpointing is None:
            pins["ckpts"] = ("overrides.cuda_graphs", (0,))
        if o.zero_stage is None:
            pins["stages"] = ("overrides.cuda_graphs", tuple(z for z in free.stages if z < 3) or free.stages)
    pinned = dataclasses.replace(free, **{axis: v for axis, (_, v) in pins.items() if v is not None})
    return pinned, list(dict.fromkeys(key for key, v in pins.values() if v is not None))


def _ep_at(n_experts: int, per_node: int, pinned_ep: int | None) -> Callable[[int], list[int]]:
    """The EP sizes the search takes at another world size (the refusal's "use N nodes" hint): the pinned
    one where AutoEP still takes it, else every one, in the fit order."""

    def ep_at(world: int) -> list[int]:
        if pinned_ep is not None and search.ep_divides(n_experts, world, pinned_ep):
            return [pinned_ep]
        return search.ep_sizes(n_experts, world, per_node)

    return ep_at


def _search_warnings(
    found: search.Search, o: PlanOverrides, forced: list[str], fabric_name: str
) -> list[str]:
    """What the plan's warnings say about the search's pick: offload, an untimed fabric, forced costs."""
    warnings = []
    if found.chosen.candidate.offload:
        if o.offload_optimizer == "cpu":
            warnings.append("optimizer states offloaded to CPU: set by overrides.offload_optimizer")
        elif any(r.fits and not r.candidate.offload for r in found.rows):
            warnings.append(
                f"optimizer states offloaded to CPU: predicted more than {search.OFFLOAD_MARGIN:.0%} faster than "
                "every fitting plan without it"
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
    return warnings


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
