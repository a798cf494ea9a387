"""The spec from a YAML file, `--set` expressions and CLI flags, validated into one `Spec` or one SpecError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from dskit.errors import SpecError
from dskit.spec import yamlsafe
from dskit.spec.run_spec import Spec, section_of
from dskit.spec.set_flag import apply_override, parse_set


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


def _valid_keys_hint(loc: tuple) -> str:
    model: type[BaseModel] = Spec
    for part in loc[:-1]:
        section = section_of(model.model_fields[str(part)].annotation)
        if section is None:
            return ""
        model = section
    return "; valid keys: " + ", ".join(model.model_fields)
