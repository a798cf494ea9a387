"""What run.yaml holds: the Plan's typed sections, and writing and reading them.

The one module the trainer, the renderers, `dskit status` and `dskit report` read the plan through:
it decides nothing. The decisions that fill these sections are `dskit/plan/build.py`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from dskit.errors import SpecError
from dskit.launch.contract import RUN_YAML
from dskit.spec import yamlsafe
from dskit.spec.targets import KubernetesSpec, SlurmSpec
from dskit.spec.tracking import TrackingSpec

PLAN_VERSION = 3  # 2: typed slurm, kubernetes and ray sections; 3: speed (predicted step time)
READABLE_VERSIONS = (2, 3)  # 3 only adds the optional speed section: runs rendered by 2 still load


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelPlan(_Frozen):
    name: str
    source: str
    trainable: bool
    untrainable_reason: str | None
    path: str | None  # local HF directory to load weights from (None: random init)
    config: dict[str, Any]  # HF config.json keys, layers already truncated
    aux_loss_coeff: float
    seq_aux: bool
    # how the experts' load is balanced (dskit/plan/balancing.py): aux_loss (no routing bias), frozen (the
    # bias as loaded), aux_free (the bias moves by bias_update_speed after each step); run.yaml files
    # from before balanced with the loss alone
    balance: Literal["aux_loss", "aux_free", "frozen"] = "aux_loss"
    bias_update_speed: float = 0.0  # gamma; 0 unless aux_free
    params_total: int
    params_active: int
    flops_per_token: float


class FinetunePlan(_Frozen):
    """A LoRA run (`finetune.method: lora`; a full fine-tune has no such section): what the trainer
    injects and trains, decided by dskit/plan/adapters.py."""

    method: Literal["lora"]
    base_precision: Literal["bf16", "fp8"]
    r: int
    alpha: float
    dropout: float
    targets: list[str]
    target_modules: str | None  # the regex peft fullmatches module names against (None: no linear)
    whole_params: str | None  # regex of base parameter names trained whole (the router), None: none
    adapter_params: int  # LoRA A + B parameters: peft's and the routed experts' (all experts)
    routed_adapter_params: int = (
        0  # of which on the routed experts (dskit/train/lora/routed.py; 1/ep per rank)
    )
    trainable_params: int  # adapters + router
    frozen_params: int


class HardwarePlan(_Frozen):
    gpu: str
    on_gpu: bool
    nodes: int
    procs_per_node: int
    world_size: int
    usable_memory_gib: float | None  # per GPU, as torch reports it; the plan fits against this
    host_memory_gib: float | None  # per node (spec, or the GPU type's reference node); None: unknown
    peak_tflops: float | None  # at the chosen precision; None: no MFU is reported


class ParallelPlan(_Frozen):
    zero_stage: int = 3  # DeepSpeed ZeRO stage (1, 2, 3); run.yaml files from before were all stage 3
    ep_size: int
    expert_dp_size: int  # ranks holding replicas of the same experts (ZeRO-3 shards experts over these)
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    activation_checkpointing: int  # 0 off, N every N-th layer
    precision: Literal["bf16", "fp16"]
    attention: str
    offload_optimizer: bool
    loss_chunk_tokens: int  # 0: full logits; N: output projection + cross-entropy N tokens at a time
    compile_regions: bool = False  # RMSNorm, SwiGLU, rotary through torch.compile (dskit/train/compile.py)
    # and each whole attention block: ZeRO-1/2 only, where no module hooks run inside it
    compile_attention: bool = False
    # the compiled attention blocks replayed as CUDA graphs (dskit/train/compile.py); False before it existed
    cuda_graphs: bool = False
    # ZeRO-1/2 without offload: torch's fused AdamW with the clip in its kernel (dskit/train/fused_step.py);
    # run.yaml files from before ran DeepSpeed's step
    optimizer_step: Literal["deepspeed", "fused"] = "deepspeed"
    # ZeRO-1/2's gradients on one rank in bf16 with the fused step: straight into flat buffers
    # (dskit/train/flat_grads.py, dskit/plan/memory.py `flat_gradients`); run.yaml files from before: buckets
    gradients: Literal["buckets", "flat"] = "buckets"
    # how a flat gradient lands in its buffer (dskit/train/flat_grads.py): "add" (AccumulateGrad adds into a
    # zeroed buffer; the plan's choice) or "copy" (a post-accumulate hook copies it, nothing zeroed: a lever
    # the benches measure with `--variant parallel.grad_first_write=copy`, bench/JOURNAL.md)
    grad_first_write: Literal["add", "copy"] = "add"
    # FP8 matrix products (training.fp8; dskit/plan/fp8_training.py): the linears' recipe (None: bf16, as every
    # run.yaml from before), the linears in FP8 by role (`self_attn.o_proj`), and the routed experts (rowwise)
    fp8: Literal["rowwise", "tensorwise"] | None = None
    fp8_linears: list[str] = []
    fp8_experts: bool = False


class OptimPlan(_Frozen):
    steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float


class RunPlan(_Frozen):
    seed: int
    log_every: int
    data_path: str | None
    # Defaults where run.yaml files rendered before these fields existed (same PLAN_VERSION) still load:
    # a run in flight, requeued by its scheduler, reads the run.yaml it was rendered with.
    data_sources: list[tuple[str, float]] | None = None  # a mixture (path, weight); then data_path is None
    eval_path: str | None = None  # None: DATA/eval if the trainer finds one (`data prepare --eval-fraction`)
    packing: Literal["pack", "pad"] = "pack"
    eval_every: int = 200
    eval_batches: int = 8
    checkpoint_dir: str
    output_dir: str
    checkpoint_every: int
    checkpoint_keep: int
    checkpoint_final: bool
    profile_steps: int  # 0: off (dskit/train/profile.py)
    # dskit/plan/hang_timeout.py; the default is the collective timeout run.yaml files from before had
    # (DeepSpeed's default_pg_timeout, 10 minutes)
    watchdog_timeout_s: float = 600.0


class LaunchPlan(_Frozen):
    runtime: Literal["pyxis", "apptainer", "none"]
    image: str
    python: str
    mounts: list[str]
    storage_root: str
    rdzv_port: int
    shm_bytes: int
    fabric: str  # the catalog fabric the plan resolved (a CPU plan: tcp, whatever the spec's default)
    fabric_rdma: bool
    fabric_k8s_resource: str | None  # the device-plugin resource pods request for it (None: none)


class RayPlan(_Frozen):
    max_failures: int
    storage_path: str  # absolute: Ray Train's checkpoints and results


class CalibrateGroup(_Frozen):
    """One kind of process group the calibration job forms and times (dskit/calibrate/measures.py)."""

    key: str  # its shape, as links.Group.key names it ("8x2": 8 ranks on each of 2 nodes)
    role: str  # which of the plan's groups has this shape ("dense", "ep 8", "expert-data-parallel at ep 8")
    size: int  # ranks per group
    stride: int  # 1: consecutive ranks; N: every N-th rank (the world splits into N such groups)
    #: op -> bytes a rank sends per byte of the whole tensor (the fit's x), for each op timed
    moved_share: dict[str, float]
    #: op -> the catalog's bus rate for this shape, GB/s (None: unknown): the preflight's yardstick
    expected_gbs: dict[str, float | None]


class CalibrateExchange(_Frozen):
    """AutoEP's dispatch and combine over one expert-parallel group shape, timed as a step runs them: its
    count exchange, its split sizes read back, its uneven all-to-alls of the routed token copies, at the
    token counts the plan's candidates dispatch (dskit/calibrate/measures.py)."""

    key: str  # the EP group's shape (a links.Group key)
    ep_size: int
    tokens: list[int]  # tokens a rank routes per micro-step, one timing each
    top_k: int
    experts: int  # routed experts of a MoE layer, over the whole EP group
    hidden: int
    expected_gbs: float | None  # the catalog's all-to-all rate for the shape: the preflight's yardstick


class CalibratePlan(_Frozen):
    """A calibration job (`dskit calibrate`): run.yaml's trainer measures instead of training."""

    file: str  # where rank 0 writes calibration.json (the run's output dir)
    groups: list[CalibrateGroup]
    sizes_bytes: list[int]  # whole-tensor sizes each op is timed at
    iters: int  # timed calls per size, after one warm-up
    #: (tokens, in, out) of the GEMM probe (a fixed shape per device kind: dskit/calibrate/measures.py)
    gemm: tuple[int, int, int] | None
    #: (batch, heads, seq, qk head dim, v head dim) of the attention probe (GPU only; fixed likewise)
    attention: tuple[int, int, int, int, int] | None
    cpu_adam_params: int  # per rank, every rank of the node stepping at once
    threads_per_rank: int
    #: the spec's fabric (the file names it; a plan on another fabric refuses the file)
    fabric: str
    #: AutoEP's exchange, per EP size the search weighs (ring collectives are in `groups`)
    exchanges: list[CalibrateExchange] = []


class Plan(_Frozen):
    version: int
    name: str
    model: ModelPlan
    hardware: HardwarePlan
    parallel: ParallelPlan
    optim: OptimPlan
    run: RunPlan
    launch: LaunchPlan
    # Target settings, validated by the spec and passed through unchanged: each renderer reads its own.
    slurm: SlurmSpec
    kubernetes: KubernetesSpec
    ray: RayPlan
    memory: dict[str, Any]
    # predicted step time by term (dskit/plan/speed.py); None: no GPU peak, or a plan of version 2
    speed: dict[str, Any] | None = None
    env: dict[str, str]  # the launch contract, minus RUN_FILE (each target adds its own path)
    deepspeed: dict[str, Any]
    warnings: list[str]
    spec: dict[str, Any]  # the validated spec, for the record only: nothing outside dskit/plan reads it
    # last, and left out of run.yaml when None: a full fine-tune's run.yaml is what it was before LoRA
    finetune: FinetunePlan | None = None
    # a calibration job's section (None, and left out of run.yaml: a training run)
    calibrate: CalibratePlan | None = None
    # the experiment trackers (dskit/train/trackers.py); None, and left out of run.yaml: TensorBoard alone
    tracking: TrackingSpec | None = None

    def _fp8_words(self) -> str:
        p = self.parallel
        if not p.fp8:
            return ""
        experts = ", experts" if p.fp8_experts else ""
        return f" + FP8 {p.fp8} ({len(p.fp8_linears)} kinds of linear{experts})"

    def summary(self) -> str:
        p, h = self.parallel, self.hardware
        return (
            f"{self.model.name} on {h.nodes}x{h.procs_per_node} {h.gpu}: world {h.world_size}, "
            f"ZeRO-{p.zero_stage}, EP {p.ep_size}, "
            f"micro-batch {p.micro_batch}, grad accum {p.grad_accum}, "
            f"{'activation checkpointing, ' if p.activation_checkpointing else ''}"
            f"{'optimizer offload, ' if p.offload_optimizer else ''}{p.precision}"
            f"{self._fp8_words()}, "
            f"{'torch.compile regions' if p.compile_regions else ''}"
            f"{' + attention' if p.compile_attention else ''}{', ' if p.compile_regions else ''}"
            f"{'fused AdamW step, ' if p.optimizer_step == 'fused' else ''}"
            f"~{self.memory['total_gib']} GiB/GPU"
            + (
                f", predicted {'at most ' if self.speed.get('not_counted') else ''}"
                f"{self.speed['tokens_per_s_per_gpu']:,} tokens/s/GPU ({self.speed['mfu']:.0%} MFU)"
                + (" (inter-node traffic not counted)" if self.speed.get("not_counted") else "")
                if self.speed
                else ""
            )
            + (
                f" [overrides: predicted {self.speed['overrides_cost']:.0%} slower than the planner's choice]"
                if self.speed and "overrides_cost" in self.speed
                else ""
            )
        )


def dump_plan(plan: Plan) -> str:
    unset = {name for name in ("finetune", "calibrate", "tracking") if getattr(plan, name) is None}
    data = plan.model_dump(mode="json", exclude=unset or None)
    return yaml.safe_dump(data, sort_keys=False, width=120)


def load_plan(path: str | Path) -> Plan:
    """Read run.yaml back. Any problem is a SpecError naming the file and the field."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(str(p), "run.yaml not found")
    data = yamlsafe.load_file(p, RUN_YAML)
    if not isinstance(data, dict):
        raise SpecError(str(p), "run.yaml must be a mapping (render it with `dskit render`)")
    if data.get("version") not in READABLE_VERSIONS:
        raise SpecError(
            f"{p}: version",
            f"expected {' or '.join(map(str, READABLE_VERSIONS))}, got {data.get('version')!r}; "
            "re-render with this dskit",
        )
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise SpecError(f"{p}: {'.'.join(str(x) for x in err['loc'])}", err["msg"]) from None
