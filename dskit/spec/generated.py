"""What is generated from the spec's models: the JSON Schema (`dskit schema`), the commented starter file
(`dskit init`) and the spec as run.yaml records it."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from dskit.spec.finetune import FinetuneSpec
from dskit.spec.run_spec import Spec
from dskit.spec.tracking import TrackingSpec


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
    """A commented spec with every field at its default, generated from the models (`Spec` and its sections)."""
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
