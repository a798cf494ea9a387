"""Strict validation of rendered custom resources (JobSet, TrainJob, Kueue's objects) against their
CRDs' OpenAPI schemas, as kubernetes-validate does for the core kinds.

The schemas live in tests/crds/ (README.md there: each one's release, commit and path). They were
taken from the upstream CRD files by `extract` (run by hand: python -m tests.support.crd_schemas
CRD.yaml VERSION OUT.json SOURCE), which keeps one version's openAPIV3Schema without its
descriptions and its status (nothing dskit renders has a status).

`validator` makes a schema strict the way the API server treats a structural schema: an object's
unknown fields are pruned there, so here they fail (additionalProperties false), unless the schema
says x-kubernetes-preserve-unknown-fields; int-or-string fields take only an integer or a string;
int32/int64 formats get their ranges; labels and annotations follow Kubernetes' key and value rules.
CEL rules (x-kubernetes-validations) are not evaluated: a test checks the ones on fields dskit sets.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parents[1] / "crds"

# Kubernetes' label rules (k8s.io/apimachinery validation: IsQualifiedName, IsValidLabelValue)
_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
LABEL_KEY = rf"^({_PREFIX}/)?{_NAME}$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_SUBSCHEMAS = ("items", "not")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")


def _without_descriptions(s: Any) -> Any:
    if not isinstance(s, dict):
        return s
    out = {}
    for k, v in s.items():
        if k == "description":
            continue
        if k == "properties":
            out[k] = {name: _without_descriptions(p) for name, p in v.items()}
        elif k in _SUBSCHEMAS or (k == "additionalProperties" and isinstance(v, dict)):
            out[k] = _without_descriptions(v)
        elif k in _SCHEMA_LISTS:
            out[k] = [_without_descriptions(x) for x in v]
        else:
            out[k] = v
    return out


def extract(crd_file: Path, version: str, source: str) -> dict:
    crd = yaml.safe_load(crd_file.read_text())
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _without_descriptions(ver["schema"]["openAPIV3Schema"])
    schema["properties"].pop("status", None)
    return {
        "apiVersion": f"{crd['spec']['group']}/{version}",
        "kind": crd["spec"]["names"]["kind"],
        "source": source,
        "openAPIV3Schema": schema,
    }


def _metadata(s: dict) -> dict:
    """ObjectMeta's labels and annotations with Kubernetes' rules on their keys and values."""
    props = dict(s.get("properties", {}))
    if "labels" in props:
        props["labels"] = {
            "type": "object",
            "propertyNames": {"pattern": LABEL_KEY},
            "additionalProperties": {"type": "string", "pattern": LABEL_VALUE},
        }
    if "annotations" in props:
        props["annotations"] = {
            "type": "object",
            "propertyNames": {"pattern": LABEL_KEY},
            "additionalProperties": {"type": "string"},
        }
    return {**s, "properties": props}


def _strict(s: Any, name: str = "") -> Any:
    if not isinstance(s, dict):
        return s
    out = dict(s)
    if name == "metadata" and "properties" in s:
        out = _metadata(out)
    if "properties" in out:
        out["properties"] = {k: _strict(v, k) for k, v in out["properties"].items()}
    for k in _SUBSCHEMAS:
        if k in out:
            out[k] = _strict(out[k])
    for k in _SCHEMA_LISTS:
        if k in out:
            out[k] = [_strict(x) for x in out[k]]
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    is_object = out.get("type") == "object" or "properties" in out
    if (
        is_object
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False  # the API server would prune it: here it fails
    if out.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [*out.get("anyOf", []), {"type": "integer"}, {"type": "string"}]
    if out.get("format") in _INT_RANGE and out.get("type") == "integer":
        lo, hi = _INT_RANGE[out["format"]]
        out.setdefault("minimum", lo)
        out.setdefault("maximum", hi)
    return out


def load(name: str) -> dict:
    return json.loads((CRDS / f"{name}.json").read_text())


def validator(name: str) -> jsonschema.Draft7Validator:
    crd = load(name)
    schema = _strict(crd["openAPIV3Schema"])
    root = schema["properties"]
    root["apiVersion"] = {"const": crd["apiVersion"]}
    root["kind"] = {"const": crd["kind"]}
    # the root's metadata is ObjectMeta, which the CRD leaves to the API server
    root["metadata"] = {
        "type": "object",
        "required": ["name"],
        "additionalProperties": False,
        "properties": {
            "name": {
                "type": "string",
                "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                "maxLength": 253,
            },
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    root["metadata"] = _metadata(root["metadata"])
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return jsonschema.Draft7Validator(schema)


def problems(obj: dict, name: str) -> list[str]:
    """Every schema violation of `obj`, as 'path: message' lines (empty: valid)."""
    errors = validator(name).iter_errors(obj)
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors)


if __name__ == "__main__":
    crd_path, version, out, source = sys.argv[1:5]
    Path(out).write_text(
        json.dumps(extract(Path(crd_path), version, source), indent=1, sort_keys=True) + "\n"
    )
