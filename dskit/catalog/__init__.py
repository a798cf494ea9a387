"""Catalogs of GPUs, fabrics and models: data files beside this module, loaded and checked here."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dskit.errors import SpecError, one_of
from dskit.formats.hf_checkpoint import check_quantization_config, json_depth
from dskit.io import bounded_read
from dskit.plan.shape import ModelShape

_HERE = Path(__file__).parent


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float | None  # datasheet
    usable_memory_gib: float | None  # what torch reports as total_memory: the plan fits against this
    usable_memory_source: str
    host_memory_gib_per_gpu: float | None  # host RAM per GPU of the GPU type's reference node
    host_memory_source: str
    compute_capability: str | None
    bf16: bool
    peak_tflops_bf16: float | None
    peak_tflops_fp16: float | None
    peak_tflops_fp8: float | None  # dense, fp32 accumulate; None: no FP8 tensor cores
    memory_bw_gbs: float | None
    interconnect_gbs: float | None  # GPU to GPU inside a node, per GPU and direction
    interconnect_source: str
    interconnect_kind: str | None  # nvlink, pcie (None: no GPU)
    pcie_gbs: float | None  # host link per GPU and direction
    flash_attn: str
    attention: str
    source: str

    @property
    def is_cpu(self) -> bool:
        return self.compute_capability is None

    @property
    def capability(self) -> tuple[int, int] | None:
        """compute_capability as (major, minor), for comparisons; None for the cpu profile."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def attention_backends(self) -> tuple[str, ...]:
        """The attention backends this profile can run: what `overrides.attention` may pin (the plan
        refuses the others, naming these) and what `attention`, the `auto` choice, must be one of."""
        return tuple(b for b in ATTENTION_BACKENDS if attention_unmet(self, b) is None)


#: every backend the trainer knows, in the spec's order (`overrides.attention`)
ATTENTION_BACKENDS = ("sdpa", "sdpa_cudnn", "flash_attention_2", "flash_attention_4", "eager")


def attention_unmet(gpu: GPU, backend: str) -> str | None:
    """Why `gpu` cannot run `backend` for MLA (q/k head dim 192, v head dim 128), or None if it can.

    The rule, in this one place (the design notes; measured on an H200):
    - sdpa, eager: any device (PyTorch's SDPA dispatcher picks a kernel that takes the shape).
    - sdpa_cudnn: the trainer disables every other SDPA kernel (train/model.py apply_sdpa_policy), and
      cuDNN takes 192/128 forward and backward only from sm90 on, with cuDNN >= 9.11 (the sm90 profiles
      build the cu130 image: cuDNN 9.19). Below sm90 no kernel is left and the first step fails.
    - flash_attention_2: only where the image builds it (`flash_attn: fa2`, sm80/86/89).
    - flash_attention_4: only where the image installs it (`flash_attn: fa4`, Hopper): dskit's own
      function (train/attention.py), MLA's 192/128 natively and packed rows through its varlen kernel.
    - the cpu profile: sdpa and eager; off CUDA the trainer (resolve_attention) runs nothing else.
    """
    if gpu.is_cpu:
        return None if backend in ("sdpa", "eager") else "the cpu profile runs only sdpa and eager"
    if backend == "sdpa_cudnn" and gpu.capability < (9, 0):
        return "cuDNN SDPA takes MLA's 192/128 head dims only on sm90 and newer"
    if backend == "flash_attention_2" and gpu.flash_attn != "fa2":
        return "FlashAttention-2 is built only into sm80/86/89 images (Hopper's carry FlashAttention-4)"
    if backend == "flash_attention_4" and gpu.flash_attn != "fa4":
        return "FlashAttention-4 is installed only into Hopper (sm90) images"
    return None


@dataclass(frozen=True)
class Fabric:
    name: str
    rdma: bool
    k8s_resource: str | None
    env: dict[str, str]
    source: str
    gbs_per_gpu: float | None  # inter-node line rate, per GPU and direction; None: unknown
    bus_gbs_per_gpu: float | None  # what NCCL's rings reach of it (the step-time model's rate)
    k8s_topology_level: str | None = None  # Kueue's default topology level (a node label); None: none


@dataclass(frozen=True)
class ModelPreset:
    name: str
    source: str
    trainable: bool
    config: dict[str, Any]
    balance: dict[str, Any] = field(default_factory=dict)
    untrainable_reason: str | None = None


@functools.cache
def _load(name: str) -> dict[str, dict]:
    return yaml.safe_load((_HERE / f"{name}.yaml").read_text())


def gpus() -> dict[str, GPU]:
    return {k: GPU(name=k, **v) for k, v in _load("gpus").items()}


def fabrics() -> dict[str, Fabric]:
    return {k: Fabric(name=k, **v) for k, v in _load("fabrics").items()}


def models() -> dict[str, ModelPreset]:
    return {k: ModelPreset(name=k, **v) for k, v in _load("models").items()}


def _get(table: dict, name: str, field_name: str):
    if name not in table:
        raise SpecError(field_name, f"unknown value {name!r}; {one_of(sorted(table))}")
    return table[name]


def gpu(name: str, field_name: str = "hardware.gpu") -> GPU:
    return _get(gpus(), name, field_name)


def fabric(name: str, field_name: str = "network.fabric") -> Fabric:
    return _get(fabrics(), name, field_name)


def model(name: str, field_name: str = "model.preset") -> ModelPreset:
    return _get(models(), name, field_name)


SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek")


#: config.json keys the planner computes with: (key, smallest value, required). Each is an integer.
CONFIG_INTS = (
    ("vocab_size", 1, True),
    ("hidden_size", 1, True),
    ("intermediate_size", 1, True),
    ("moe_intermediate_size", 1, True),
    ("num_hidden_layers", 1, True),
    ("num_attention_heads", 1, True),
    ("n_routed_experts", 1, True),
    ("num_experts_per_tok", 1, True),
    ("n_shared_experts", 0, False),
    ("first_k_dense_replace", 0, False),
    ("kv_lora_rank", 0, False),
    ("q_lora_rank", 0, False),
    ("qk_nope_head_dim", 1, False),
    ("qk_rope_head_dim", 1, False),
    ("v_head_dim", 1, False),
    ("max_position_embeddings", 1, False),
)
CONFIG_MAX = {"num_hidden_layers": 10_000}
CONFIG_INT_MAX = 2**31
#: config.json travels inside run.yaml, which the trainer reads with dskit.spec.yamlsafe's limits (1 MiB,
#: 64 levels): a config within these always fits, so render never writes a run.yaml the trainer refuses.
CONFIG_MAX_BYTES = 1 << 20
CONFIG_MAX_DEPTH = 32


def _finite(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    return True


def check_config(cfg: Any, where: str, field_name: str = "model.path") -> dict[str, Any]:
    """A config.json's content, checked for what the planner needs: one line naming the key otherwise."""
    if not isinstance(cfg, dict):
        raise SpecError(field_name, f"{where} must hold a JSON object, not a {type(cfg).__name__}")
    if json_depth(cfg) > CONFIG_MAX_DEPTH:
        raise SpecError(field_name, f"{where} nests deeper than {CONFIG_MAX_DEPTH} levels")
    for key, low, required in CONFIG_INTS:
        v = cfg.get(key)
        if v is None and not required:
            continue
        high = CONFIG_MAX.get(key, CONFIG_INT_MAX)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            need = "required, " if required else ""
            raise SpecError(
                field_name, f"{key} in {where} is {v!r}; {need}an integer from {low} to {high} expected"
            )
    if not _finite(cfg):
        raise SpecError(field_name, f"{where} holds NaN or Infinity; every number must be finite")
    shape = ModelShape.from_config(cfg)
    if shape.active_experts > shape.routed_experts:
        raise SpecError(field_name, f"num_experts_per_tok in {where} exceeds n_routed_experts")
    if shape.mla:
        for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if cfg.get(key) is None:
                raise SpecError(field_name, f"{key} in {where} is required with kv_lora_rank (MLA)")
    elif shape.hidden % shape.heads:
        raise SpecError(field_name, f"hidden_size in {where} is not a multiple of num_attention_heads")
    return cfg


def model_from_path(path: str, field_name: str = "model.path") -> ModelPreset:
    """A local Hugging Face model dir or config.json, as a preset. Nothing is downloaded."""
    p = Path(path)
    try:
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.is_file():
            raise SpecError(field_name, f"{cfg_file} not found (expected a model directory with config.json)")
        cfg = bounded_read.read_json(
            cfg_file, limit=CONFIG_MAX_BYTES, what="a config.json", depth=CONFIG_MAX_DEPTH
        )
    except bounded_read.TooLarge as e:
        raise SpecError(field_name, str(e)) from None
    except OSError as e:
        raise SpecError(field_name, f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SpecError(field_name, f"{cfg_file} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise SpecError(field_name, f"{cfg_file} is not valid JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # a number beyond Python's digit limit, deep nesting
        raise SpecError(field_name, f"{cfg_file} is not a usable config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise SpecError(field_name, f"{cfg_file} must hold a JSON object, not a {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise SpecError(
            field_name,
            f"model_type {mt!r} in {cfg_file} is not a DeepSeek MoE; {one_of(SUPPORTED_MODEL_TYPES)}",
        )
    quantization = cfg.get("quantization_config")
    if quantization is not None:
        # DeepSeek-V3's FP8 weights load dequantised (dskit/train/fp8/loading.py); anything else is refused.
        # The model is built and trained in bf16, so the config the plan keeps has no quantization_config.
        check_quantization_config(quantization, str(cfg_file), field_name)
    check_config(cfg, str(cfg_file), field_name)
    keep = {
        k: v
        for k, v in cfg.items()
        if not k.startswith("_")
        and k
        not in (
            "architectures",
            "auto_map",
            "transformers_version",
            "torch_dtype",
            "dtype",
            "quantization_config",
        )
    }
    balance = {k: cfg[k] for k in ("aux_loss_alpha", "seq_aux") if k in cfg}
    aux = balance.get("aux_loss_alpha", 0.0)
    if isinstance(aux, bool) or not isinstance(aux, (int, float)) or not 0 <= aux < float("inf"):
        raise SpecError(field_name, f"aux_loss_alpha in {cfg_file} is {aux!r}; a finite number >= 0 expected")
    trainable = mt != "deepseek"
    return ModelPreset(
        name=p.name if p.is_dir() else p.parent.name,
        source=str(cfg_file),
        trainable=trainable,
        config=keep,
        balance=balance,
        untrainable_reason=None if trainable else models()["deepseek-moe-16b"].untrainable_reason,
    )
