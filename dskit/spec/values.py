"""What any run spec value may be: the safe alphabets of names, paths and Kubernetes/Slurm words, the
integer range, and `_Section`, the strict base of every spec section (dskit/spec/sections.py, training.py, targets.py, ...)
that applies them to every field.
"""

from __future__ import annotations

import re
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from dskit.io.text import describe, first_unsafe

# Identifiers land in #SBATCH lines, Kubernetes names and file names: keep them to a safe alphabet.
# Every pattern ends in \Z, not $ (which also matches before a trailing newline), and spells digits
# [0-9] (\d also matches non-ASCII digits). helm_values.portable() turns \Z into $ for JSON Schema.
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,50}[a-z0-9])?\Z")
SLURM_WORD_RE = re.compile(r"^[A-Za-z0-9_.,-]+\Z")
MAX_SLURM_DAYS = 365
SLURM_TIME_RE = re.compile(r"^([0-9]+-)?[0-9]{1,3}:[0-9]{2}(:[0-9]{2})?\Z")
SBATCH_ARG_RE = re.compile(r"^--[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:/@%+=-]+)?\Z")
# Kubernetes object names (RFC 1123 labels), quantities ("500m", "64Gi") and label keys.
K8S_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")
K8S_QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?\Z")
K8S_LABEL_KEY_RE = re.compile(
    r"^([a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?\Z"
)
K8S_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?\Z")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
SECRET_KEY_RE = re.compile(r"^[A-Za-z0-9._-]+\Z")
#: Integers beyond this are refused everywhere (they only overflow the float arithmetic of the plan).
MAX_INT = 2**53


def _check_value(v: Any) -> None:
    """Strings (list items, mapping keys and values included) and numbers every field must obey."""
    if isinstance(v, str):
        bad = first_unsafe(v)
        if bad is not None:
            # Any string may reach a shell or a YAML file; quoting handles the rest, but a newline, NUL,
            # line separator or C1 control in a path is always a mistake and breaks line-oriented
            # formats (#SBATCH, env files, YAML readers that end lines at U+2028/U+0085).
            raise ValueError(
                f"must not contain control characters or line separators (found {describe(bad)})"
            )
    elif isinstance(v, bool):
        pass
    elif isinstance(v, int) and abs(v) > MAX_INT:
        raise ValueError(f"must be between -2**53 and 2**53, got a {len(str(abs(v)))}-digit number")
    elif isinstance(v, list):
        for item in v:
            _check_value(item)
    elif isinstance(v, dict):
        for key, item in v.items():
            _check_value(key)
            _check_value(item)


#: The empty-value rule: no spec value, and no item or key inside one, may be empty or only whitespace.
#: Leaving a key out (or `null`, `--set KEY=null`) is how a default is asked for; an empty value is an
#: unset variable (`--set model.path=$MODEL_DIR`) and never silently means the default. Mapping values
#: are exempt: a Kubernetes label value may be empty. Checked before any other rule of the field.
BLANK = "is empty; leave the key out (or null) for the default"
BLANK_INSIDE = {
    list: "holds an empty or blank item; remove it",
    dict: "has an empty or blank key",
}


def _blank(v: Any) -> bool:
    """Whether `v`, or a list item or mapping key in it, is an empty or whitespace-only string."""
    if isinstance(v, str):
        return not v.strip()
    if isinstance(v, list):
        return any(_blank(item) for item in v)
    if isinstance(v, dict):
        return any(isinstance(key, str) and not key.strip() for key in v)
    return False


class _Section(BaseModel):
    # allow_inf_nan=False: .inf/.nan would reach deepspeed.json as Infinity/NaN (not JSON) or the trainer.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _safe_values(cls, v: Any) -> Any:
        _check_value(v)
        return v

    @field_validator("*", mode="before")
    @classmethod
    def _no_blank_values(cls, v: Any) -> Any:
        if _blank(v):
            raise ValueError(BLANK if isinstance(v, str) else BLANK_INSIDE[type(v)])
        return v

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1: `nodes: true` is a mistake, not one node
        if isinstance(v, bool) and info.field_name:
            ann = cls.model_fields[info.field_name].annotation
            if bool not in (get_args(ann) or (ann,)) and ({int, float} & set(get_args(ann) or (ann,))):
                raise ValueError("must be a number, not true/false")
        return v
