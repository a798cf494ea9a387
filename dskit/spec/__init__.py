"""The run spec: what the user asks for. Loaded from YAML, overridden by --set and CLI flags, validated.

The pydantic models are the single source of truth for the spec: validation, the JSON Schema
(`dskit schema`), and the commented starter file (`dskit init`) are all generated from them. By concern:
`Spec` itself in run_spec.py; its general sections in sections.py, the training section in training.py,
the planner's pins in plan_overrides.py, the target sections (slurm, ray, kubernetes) in targets.py,
finetune.py and tracking.py; the rules every value obeys in values.py; `--set` in set_flag.py; loading
and validation in load.py; the schema, starter file and run.yaml record in generated.py.
Catalog names (GPU, model, fabric) are checked against the catalogs in `dskit.catalog`, not here,
so the allowed values in errors always match the data files.
"""

from __future__ import annotations

from dskit.spec.generated import json_schema, spec_record, starter_yaml
from dskit.spec.load import load_spec, validate_spec
from dskit.spec.plan_overrides import PlanOverrides
from dskit.spec.run_spec import Spec
from dskit.spec.sections import (
    CheckpointSpec,
    DataSource,
    DataSpec,
    HardwareSpec,
    ModelSpec,
    NetworkSpec,
    RuntimeSpec,
    StorageSpec,
    WatchdogSpec,
)
from dskit.spec.set_flag import SET_RULE, apply_override, parse_set, set_value
from dskit.spec.training import TrainingSpec

__all__ = [
    "SET_RULE",
    "CheckpointSpec",
    "DataSource",
    "DataSpec",
    "HardwareSpec",
    "ModelSpec",
    "NetworkSpec",
    "PlanOverrides",
    "RuntimeSpec",
    "Spec",
    "StorageSpec",
    "TrainingSpec",
    "WatchdogSpec",
    "apply_override",
    "json_schema",
    "load_spec",
    "parse_set",
    "set_value",
    "spec_record",
    "starter_yaml",
    "validate_spec",
]
