"""The run spec: what the user asks for. Loaded from YAML, overridden by --set and CLI flags, validated.

The pydantic models are the single source of truth for the spec: validation, the JSON Schema
(`dskit schema`), and the commented starter file (`dskit init`) are all generated from them. This
module holds the Spec, its general sections and the loading; the target sections (slurm, ray,
kubernetes) are in dskit/spec/targets.py, the rules every value obeys in dskit/spec/values.py.
Catalog names (GPU, model, fabric) are checked against the catalogs in `dskit.catalog`, not here,
so the allowed values in errors always match the data files.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

from dskit.data import MIXTURE_BLOCK
from dskit.errors import SpecError
from dskit.spec import yamlsafe
from dskit.spec.finetune import FinetuneSpec
from dskit.spec.targets import KubernetesSpec, RaySpec, SlurmSpec
from dskit.spec.tracking import TrackingSpec
from dskit.spec.values import NAME_RE, _Section


class ModelSpec(_Section):
    preset: str | None = Field(
        None, description="Catalog model name (see `dskit catalog models`). Default: deepseek-v2-lite."
    )
    path: str | None = Field(
        None,
        description="Local Hugging Face model directory (config.json, optionally *.safetensors to start from) "
        "or a config.json file. Exclusive with preset. Nothing is ever downloaded.",
    )
    num_layers: int | None = Field(
        None, ge=1, description="Keep only the first N decoder layers (smoke tests, benchmarks)."
    )


class HardwareSpec(_Section):
    gpu: str = Field("h100-80gb", description="GPU profile from the catalog (`cpu` for tests and demos).")
    gpus_per_node: int = Field(
        8, ge=1, le=1024, description="GPUs (or, for the cpu profile, processes) per node."
    )
    nodes: int = Field(1, ge=1, le=10000, description="Number of nodes.")
    cpus_per_node: int | None = Field(
        None,
        ge=1,
        description="Host CPU cores per node; sets OMP_NUM_THREADS. Default: 8 per GPU, 1 for cpu.",
    )
    host_memory_gib: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description="Host RAM per node in GiB, checked against optimizer offload and model construction. "
        "Default: the GPU profile's host_memory_gib_per_gpu (its reference node, e.g. DGX H100: 2 TiB / 8) x "
        "gpus_per_node; unknown, so unchecked, for cpu.",
    )
    calibration: str | None = Field(
        None,
        min_length=1,
        description="calibration.json written by `dskit calibrate` on this cluster: the plan then times "
        "collectives and CPU Adam at the rates measured there (docs/planner.md). Default: the catalogs' rates.",
    )


class NetworkSpec(_Section):
    fabric: str = Field("infiniband", description="Network fabric from the catalog.")
    interface: str | None = Field(
        None, description="Socket interface for NCCL/Gloo bootstrap (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)."
    )
    ib_hca: str | None = Field(None, description="NCCL_IB_HCA filter, e.g. 'mlx5_0,mlx5_1' (RDMA fabrics).")


class RuntimeSpec(_Section):
    kind: Literal["pyxis", "apptainer", "none"] = Field(
        "pyxis", description="How Slurm starts the container: pyxis/enroot, apptainer, or none (a bare venv)."
    )
    image: str = Field(
        "dskit:latest",
        min_length=1,
        description="Container image (pyxis: registry ref or .sqsh; apptainer: .sif path). Build it with "
        "`dskit render image`.",
    )
    mounts: list[str] = Field(
        default_factory=list, description="Extra bind mounts 'SRC:DST' (the storage root is always mounted)."
    )
    python: str = Field(
        "python3",
        min_length=1,
        description="Python interpreter inside the runtime (an absolute venv path for none).",
    )


class TrainingSpec(_Section):
    seq_len: int = Field(4096, ge=8, description="Tokens per sequence.")
    global_batch: int | None = Field(
        None,
        ge=1,
        description="Sequences per optimizer step, over all ranks. Default: 256 (about 1M tokens at seq 4096), "
        "or 4 per GPU on clusters of more than 64 GPUs (1024 at 256 GPUs), rounded up to a multiple of the "
        "world size (264 at 24 GPUs).",
    )
    steps: int = Field(1000, ge=1, description="Optimizer steps.")
    fp8: Literal["off", "on", "rowwise", "tensorwise", "blockwise"] = Field(
        "off",
        description="FP8 matrix products (torchao) in the decoder's linears and the routed experts' grouped "
        "GEMMs, with bf16 master weights, optimizer states and the layers the plan keeps in bf16 (router, "
        "embeddings, output head). It changes the numerics, so it is off unless asked: on lets the plan pick "
        "the fastest recipe for the GPU; rowwise: one scale per row of each operand; tensorwise: one per "
        "tensor in the dense linears (the experts stay rowwise); blockwise: DeepSeek-V3's 1x128 activation "
        "and 128x128 weight tiles. Hopper and newer only (the experts' FP8 grouped GEMM). `dskit plan "
        "--explain` shows bf16 beside FP8.",
    )
    lr: float = Field(1.5e-4, gt=0, le=10, description="Peak learning rate (the seed post's tuned 1.5e-4).")
    warmup_ratio: float = Field(
        0.03, ge=0, lt=1, description="Linear warmup as a fraction of steps (seed: 3%)."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor as a fraction of lr.")
    weight_decay: float = Field(0.1, ge=0, le=10, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="Gradient norm clip (0 disables).")
    seed: int = Field(1234, ge=0, le=2**32 - 1, description="Seed for init and data order.")
    log_every: int = Field(10, ge=1, description="Steps between log lines / metrics records.")
    eval_every: int = Field(
        200,
        ge=1,
        description="Steps between eval losses on the held-out set (and one at the end); only when there is "
        "one: data.eval_path, or DATA/eval from `dskit data prepare --eval-fraction`.",
    )
    eval_batches: int = Field(
        8,
        ge=1,
        le=100000,
        description="Micro-batches per rank in one eval (the same held-out samples every time; fewer when "
        "the held-out set is smaller).",
    )
    profile_steps: int = Field(
        0,
        ge=0,
        le=1000,
        description="Profile this many steps on rank 0 after a 5-step warm-up: OUTPUT_DIR/profile.json "
        "(time per step by kernel category) and a Chrome trace. 0: off.",
    )
    aux_loss_coeff: float | None = Field(
        None,
        ge=0,
        le=1e3,
        description="MoE balance loss coefficient. Default: the model config's aux_loss_alpha; with "
        "balance aux_free, the paper's sequence-wise 1e-4.",
    )
    balance: Literal["auto", "aux_free", "frozen"] = Field(
        "auto",
        description="Expert load balancing of models with a routing bias (DeepSeek-V3's e_score_correction_bias, "
        "noaux_tc routing). aux_free: after each step every expert's bias moves by bias_update_speed towards "
        "the mean load (arXiv:2412.19437 Sec. 2.1.2), beside a small balance loss; frozen: the bias stays as "
        "loaded and the balance loss alone balances. auto: aux_free on models with the bias (frozen for LoRA "
        "runs, which may set aux_free: their adapter export then carries every router whole); models without "
        "one balance with the loss alone.",
    )
    bias_update_speed: float | None = Field(
        None,
        gt=0,
        le=1,
        description="The bias update speed gamma of balance aux_free. Default: 0.001, the paper's for most "
        "of pre-training.",
    )


class DataSource(_Section):
    path: str = Field(..., min_length=1, description="Token shard directory from `dskit data prepare`.")
    weight: float = Field(
        ..., gt=0, le=1e6, description="Share of the samples, relative to the other sources."
    )


class DataSpec(_Section):
    sources: list[DataSource] | None = Field(
        None,
        description="A mixture instead of data.path: [{path, weight}, ...]; each sample comes from one source, "
        "in proportion to the weights, deterministically from (seed, sample number). Same tokenizer and kind. "
        "The eval loss reads data.eval_path (the sources' own DIR/eval splits are not mixed).",
    )

    @field_validator("sources")
    @classmethod
    def _some_sources(cls, v: list | None) -> list | None:
        if v is not None and not v:
            raise ValueError("must list at least one {path, weight}, or be left out (use data.path)")
        total = sum(s.weight for s in v or [])
        for i, s in enumerate(v or []):
            if s.weight / total < 1 / MIXTURE_BLOCK:  # Mixture gives it no slot: never sampled
                raise ValueError(
                    f"[{i}].weight {s.weight:g} is below 1/{MIXTURE_BLOCK} of the total {total:g}: that source "
                    f"would never be sampled; raise it or drop the source"
                )
        return v

    path: str | None = Field(
        None,
        description="Token shard directory from `dskit data prepare`. Default: the embedded corpus, "
        "byte-tokenized at start (demo and tests).",
    )
    eval_path: str | None = Field(
        None,
        description="Held-out shard directory for the eval loss. Default: DATA/eval when `data prepare "
        "--eval-fraction` wrote one, else no eval.",
    )
    packing: Literal["pack", "pad"] = Field(
        "pack",
        description="Chat data: 'pack' fills each row with whole samples (attention stays inside each), "
        "'pad' puts one sample per row, each micro-batch only as wide as a bucket of its longest sample. "
        "Text data always uses windows across documents.",
    )


class StorageSpec(_Section):
    root: str = Field(
        "/shared/dskit", min_length=1, description="Shared filesystem root; run dirs go under ROOT/NAME."
    )
    checkpoint_dir: str | None = Field(None, description="Default: ROOT/NAME/checkpoints.")
    output_dir: str | None = Field(None, description="Default: ROOT/NAME/outputs (metrics, exports).")


class CheckpointSpec(_Section):
    every: int = Field(200, ge=1, description="Steps between checkpoints (also saved on SIGUSR1/SIGTERM).")
    keep: int = Field(
        3, ge=1, le=1000, description="Checkpoints kept; older ones are deleted after a good save."
    )
    final: bool = Field(
        True,
        description="Save after the last step (with the probe `dskit export` verifies). Off for benchmarks.",
    )


class WatchdogSpec(_Section):
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=7 * 24 * 3600,
        description="Seconds without a finished step (or eval, or checkpoint save) after which a rank counts "
        "as hung: the job writes the reason and the stuck ranks' stacks to its log and exits 75 to be "
        "restarted from the last checkpoint (or 1, a failure, if it hangs before its first step); collectives "
        "time out 60 s later. Default: the larger of "
        "600 s, 20 predicted steps and 3 predicted checkpoint saves (dskit/plan/hang_timeout.py).",
    )


class PlanOverrides(_Section):
    """Anything the planner decides can be pinned here; `auto`/null lets the planner choose: the
    fastest candidate that fits (`dskit plan --explain` shows them all)."""

    ep_size: int | None = Field(
        None,
        ge=1,
        description="Expert-parallel group size (AutoEP autoep_size). Default: the predicted fastest.",
    )
    zero_stage: int | None = Field(
        None,
        ge=1,
        le=3,
        description="DeepSpeed ZeRO stage. 3: weights, gradients and optimizer states sharded (gathered per "
        "layer); 2: gradients and optimizer states sharded, 16-bit weights whole on every GPU (the model is "
        "built whole on each GPU first); 1: optimizer states sharded. Default: the predicted fastest "
        "that fits (ZeRO-3 on the cpu profile).",
    )
    micro_batch: int | None = Field(
        None,
        ge=1,
        description="Sequences per GPU per forward; the rest of the per-GPU batch is gradient accumulation.",
    )
    activation_checkpointing: int | None = Field(
        None,
        ge=0,
        description="0: off; 1: every layer; N: layers 0, N, 2N, ... (the others keep their activations). "
        "Default: the predicted fastest that fits of off, every 2nd layer and every layer.",
    )
    precision: Literal["auto", "bf16", "fp16"] = Field(
        "auto", description="bf16 where the GPU has it, else fp16 with dynamic loss scaling."
    )
    attention: Literal["auto", "sdpa", "sdpa_cudnn", "flash_attention_2", "flash_attention_4", "eager"] = (
        Field("auto", description="Attention backend. auto: the GPU profile's measured-fastest.")
    )
    offload_optimizer: Literal["auto", "none", "cpu"] = Field(
        "auto",
        description="ZeRO optimizer-state offload. auto: whichever the predicted fastest candidate that fits uses.",
    )
    compile: Literal["auto", "off", "regions", "on"] = Field(
        "auto",
        description="torch.compile. regions: the decoder's RMSNorm, SwiGLU and rotary code (measured on H200: "
        "8% faster and 7.6 GiB less where the step is GPU-bound); on: those and, under ZeRO-1/2, each whole "
        "attention block (3.7-7.5% more at micro-batch 2, 3% at 16). auto: on for GPUs; off on the cpu profile, "
        "where inductor's C++ compile costs more than a test run saves.",
    )
    optimizer_step: Literal["auto", "deepspeed", "fused"] = Field(
        "auto",
        description="ZeRO-1/2's optimizer step. fused: torch's fused AdamW, with the gradient clip applied "
        "inside its kernel and the gradient norm taken in fp32 without copies (measured on one H200 at "
        "micro-batch 2: 6-11% more tokens/s in two calls); deepspeed: DeepSpeed's FusedAdam step, as before. auto: fused "
        "wherever it applies (ZeRO-1/2 without optimizer offload; ZeRO-3 and offload keep DeepSpeed's).",
    )
    loss: Literal["auto", "chunked", "full"] = Field(
        "auto",
        description="Language-model loss. chunked: output projection + cross-entropy a few thousand tokens "
        "at a time, never the batch x seq x vocab logits; full: the plain logits path. auto: chunked where it "
        "needs less memory (micro-steps of more than one 4096-token chunk, roughly).",
    )


class Spec(_Section):
    name: str = Field(
        "dskit-run", description="Run name: lowercase letters, digits and '-' (job and dir names)."
    )
    model: ModelSpec = Field(default_factory=ModelSpec)
    hardware: HardwareSpec = Field(default_factory=HardwareSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    watchdog: WatchdogSpec = Field(default_factory=WatchdogSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)
    ray: RaySpec = Field(default_factory=RaySpec)
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)
    overrides: PlanOverrides = Field(default_factory=PlanOverrides)
    finetune: FinetuneSpec = Field(default_factory=FinetuneSpec)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(
                "must be 1-52 lowercase letters, digits or '-', starting and ending alphanumeric"
            )
        return v


# --------------------------------------------------------------------------- loading


#: The `--set VALUE` rule (also in `--help` and docs/spec.md): VALUE is a literal string unless it is
#: clearly something else: an integer or decimal number ([0-9] digits, optional sign, point and
#: exponent), true/false, null, or a [a, b] list or {k: v} mapping (YAML flow syntax, one level of
#: plain values). Nothing else is parsed: `48:00:00` stays a time, `#` is not a comment, quotes are
#: characters.
SET_RULE = (
    "VALUE is taken literally (no YAML: '#' and quotes are characters) unless it is a number, "
    "true/false, null, a [a, b] list or a {k: v} mapping"
)
_SET_INT = re.compile(r"[-+]?[0-9]{1,30}\Z")
_SET_FLOAT = re.compile(r"[-+]?([0-9]{1,30}\.[0-9]{0,30}|\.[0-9]{1,30}|[0-9]{1,30})([eE][-+]?[0-9]{1,3})?\Z")


def parse_set(expr: str) -> tuple[str, Any]:
    """'a.b=v' -> ('a.b', v), v per SET_RULE."""
    key, sep, raw = expr.partition("=")
    if not sep or not key.strip():
        raise SpecError("--set", f"{expr!r} is not KEY=VALUE (e.g. training.steps=100)")
    return key.strip(), set_value(raw, key.strip())


def set_value(raw: str, where: str = "--set") -> Any:
    """One --set VALUE per SET_RULE."""
    word = raw.strip()
    if _SET_INT.match(word):
        return int(word)
    if _SET_FLOAT.match(word):
        return float(word)
    if word in ("true", "false"):
        return word == "true"
    if word == "null":
        return None
    if (word[:1], word[-1:]) in (("[", "]"), ("{", "}")):
        items = yamlsafe.loads(word, where)
        plain = items if isinstance(items, list) else [*items.keys(), *items.values()]
        if any(isinstance(i, (list, dict)) for i in plain):
            raise SpecError(where, f"{raw!r} is not a [a, b] list or {{k: v}} mapping of plain values")
        return items
    return raw


def _takes_text(annotation: Any) -> bool:
    """Whether a field holds text (str, str | None), so a number-looking --set value stays a string."""
    args = get_args(annotation) or (annotation,)
    return str in args and not any(a in (int, float, bool) for a in args)


def apply_override(data: dict, dotted: str, value: Any, *, raw: str | None = None) -> None:
    """Set data[a][b] = value for 'a.b', refusing keys the spec does not have. `raw`: the --set text,
    used as is when the field holds text (`--set slurm.partition=123` is the partition '123')."""
    parts = dotted.split(".")
    model: type[BaseModel] | None = Spec
    node = data
    for i, part in enumerate(parts):
        fields = model.model_fields if model else {}
        if part not in fields:
            where = ".".join(parts[:i]) or "spec"
            raise SpecError(dotted, f"unknown key {part!r} in {where}; valid keys: {', '.join(fields)}")
        ann = fields[part].annotation
        model = _section(ann)
        if i == len(parts) - 1:
            if raw is not None and isinstance(value, (int, float)) and _takes_text(ann):
                value = raw
            node[part] = value
        else:
            if model is None:
                raise SpecError(dotted, f"{'.'.join(parts[: i + 1])} is a value, not a section")
            if node.get(part) is None:  # absent, or an optional section left null: setting a key turns it on
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise SpecError(dotted, f"{'.'.join(parts[: i + 1])} must be a mapping")


def load_spec(
    path: str | Path | None = None, sets: list[str] | None = None, flags: dict[str, Any] | None = None
) -> Spec:
    """Spec from an optional YAML file, then --set expressions, then CLI flags (highest priority)."""
    data: dict = {}
    if path is not None:
        loaded = yamlsafe.load_file(path, "spec file")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise SpecError(str(path), "the spec must be a YAML mapping")
        data = loaded
    for expr in sets or []:
        key, value = parse_set(expr)
        apply_override(data, key, value, raw=expr.partition("=")[2])
    for dotted, value in (flags or {}).items():
        if value is not None:
            apply_override(data, dotted, value)
    return validate_spec(data)


def validate_spec(data: dict) -> Spec:
    try:
        spec = Spec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "spec"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + _valid_keys_hint(err["loc"])
        raise SpecError(field, msg) from None
    if spec.model.preset and spec.model.path:
        raise SpecError("model", "set either model.preset or model.path, not both")
    return spec


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds: X, or X | None (an optional section, off while null)."""
    args = [annotation]
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
    ok = len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel)
    return args[0] if ok else None


def _valid_keys_hint(loc: tuple) -> str:
    model: type[BaseModel] = Spec
    for part in loc[:-1]:
        section = _section(model.model_fields[str(part)].annotation)
        if section is None:
            return ""
        model = section
    return "; valid keys: " + ", ".join(model.model_fields)


def spec_record(spec: Spec) -> dict[str, Any]:
    """The spec as run.yaml records it. A full fine-tune (the default) leaves the finetune section out,
    and TensorBoard alone (the default) the tracking section, so a spec that mentions neither renders
    exactly what it rendered before those sections existed."""
    default = {"finetune": FinetuneSpec(), "tracking": TrackingSpec()}
    return spec.model_dump(
        mode="json", exclude={k for k, v in default.items() if getattr(spec, k) == v} or None
    )


def json_schema() -> dict:
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "dskit run spec"
    return schema


def starter_yaml() -> str:
    """A commented spec with every field at its default, generated from the models above."""
    lines = [
        "# dskit run spec. Every key is optional; the values shown are the defaults.",
        "# Validate and preview: dskit plan SPEC.yaml   Schema: dskit schema",
    ]

    def emit(model: type[BaseModel], instance: BaseModel, indent: int) -> None:
        pad = "  " * indent
        for name, field in model.model_fields.items():
            value = getattr(instance, name)
            if field.description:
                lines.append(f"{pad}# {field.description}")
            if isinstance(value, BaseModel):
                lines.append(f"{pad}{name}:")
                emit(type(value), value, indent + 1)
            else:
                dumped = yaml.safe_dump({name: value}, default_flow_style=True, width=1000).strip()
                lines.append(f"{pad}{dumped[1:-1]}")  # drop the outer flow braces only

    emit(Spec, Spec(), 0)
    return "\n".join(lines) + "\n"
