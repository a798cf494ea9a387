"""`Spec`, the whole run spec: one field per section, in the order `dskit init` writes them."""

from __future__ import annotations

from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, Field, field_validator

from dskit.spec.finetune import FinetuneSpec
from dskit.spec.plan_overrides import PlanOverrides
from dskit.spec.sections import (
    CheckpointSpec,
    DataSpec,
    HardwareSpec,
    ModelSpec,
    NetworkSpec,
    RuntimeSpec,
    StorageSpec,
    WatchdogSpec,
)
from dskit.spec.targets import KubernetesSpec, RaySpec, SlurmSpec
from dskit.spec.tracking import TrackingSpec
from dskit.spec.training import TrainingSpec
from dskit.spec.values import NAME_RE, _Section


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


def section_of(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds: X, or X | None (an optional section, off while null)."""
    args = [annotation]
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
    ok = len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel)
    return args[0] if ok else None
