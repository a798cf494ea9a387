"""Catalogs of GPUs, fabrics and models: data files beside this module, loaded and checked here."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dskit.errors import SpecError, one_of

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
    memory_bw_gbs: float | None
    interconnect: str
    flash_attn: str
    attention: str
    source: str

    @property
    def is_cpu(self) -> bool:
        return self.compute_capability is None


@dataclass(frozen=True)
class Fabric:
    name: str
    rdma: bool
    k8s_resource: str | None
    env: dict[str, str]
    source: str


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


def model_from_path(path: str, field_name: str = "model.path") -> ModelPreset:
    """A local Hugging Face model dir or config.json, as a preset. Nothing is downloaded."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise SpecError(field_name, f"{cfg_file} not found (expected a model directory with config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(field_name, f"{cfg_file} is not valid JSON: {e}") from None
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise SpecError(
            field_name,
            f"model_type {mt!r} in {cfg_file} is not a DeepSeek MoE; {one_of(SUPPORTED_MODEL_TYPES)}",
        )
    if cfg.get("quantization_config"):
        from dskit.hf_checkpoint import FP8_HOWTO

        method = (
            cfg["quantization_config"].get("quant_method", "?")
            if isinstance(cfg["quantization_config"], dict)
            else "?"
        )
        raise SpecError(field_name, f"{cfg_file} describes {method}-quantized weights; {FP8_HOWTO}")
    keep = {
        k: v
        for k, v in cfg.items()
        if not k.startswith("_")
        and k not in ("architectures", "auto_map", "transformers_version", "torch_dtype", "dtype")
    }
    balance = {k: cfg[k] for k in ("aux_loss_alpha", "seq_aux") if k in cfg}
    trainable = mt != "deepseek"
    return ModelPreset(
        name=p.name if p.is_dir() else p.parent.name,
        source=str(cfg_file),
        trainable=trainable,
        config=keep,
        balance=balance,
        untrainable_reason=None if trainable else models()["deepseek-moe-16b"].untrainable_reason,
    )
