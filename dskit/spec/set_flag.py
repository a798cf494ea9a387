"""`--set KEY=VALUE`: how VALUE is read, and how a dotted KEY lands in the spec's data before validation."""

from __future__ import annotations

import re
from typing import Any, get_args

from pydantic import BaseModel

from dskit.errors import SpecError
from dskit.spec import yamlsafe
from dskit.spec.run_spec import Spec, section_of

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
        model = section_of(ann)
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
