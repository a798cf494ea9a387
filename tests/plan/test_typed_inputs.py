"""The planner computes with typed objects, not a config dict and long argument lists: the model's
dimensions are read from its config.json once (`ModelShape.from_config`, dskit/plan/shape.py), and a
candidate travels with its workload and cluster as objects (dskit/plan/candidate.py), so no function
of dskit/plan takes more than MAX_PARAMETERS parameters."""

from __future__ import annotations

import ast
from pathlib import Path

from dskit import catalog
from dskit.plan.shape import ModelShape
from tests.conftest import REPO

MAX_PARAMETERS = 8
#: the planner's side of the package, where a model's config is read for its dimensions (the trainer
#: builds the model from the same dict, through transformers)
PLANNER = ("dskit/plan", "dskit/calibrate", "dskit/catalog")
#: every config.json key the shape holds
SHAPE_KEYS = {key for key, _, _ in catalog.CONFIG_INTS} | {"tie_word_embeddings"}


def _functions(path: Path) -> list[tuple[str, int]]:
    """(name, parameter count) of every function and method in `path`; `self` and `cls` not counted."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            out.append((node.name, len([n for n in names if n not in ("self", "cls")])))
    return out


def test_no_plan_function_takes_more_than_eight_parameters():
    found = {
        f"{p.relative_to(REPO)}::{name}": n
        for p in sorted((REPO / "dskit" / "plan").glob("*.py"))
        for name, n in _functions(p)
    }
    assert "dskit/plan/speed.py::predict" in found  # the walk sees the functions at all
    assert {f: n for f, n in found.items() if n > MAX_PARAMETERS} == {}


def _shape_key_reads(path: Path) -> list[str]:
    """Where `path` reads a shape key from a dict: `x["key"]` or `x.get("key", ...)`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            key = node.args[0].value
        if key in SHAPE_KEYS:
            out.append(f"{path.relative_to(REPO)}:{node.lineno} {key}")
    return out


def test_the_planner_reads_the_models_dimensions_only_in_the_shapes_constructor():
    shape_py = REPO / "dskit/plan/shape.py"
    assert len(_shape_key_reads(shape_py)) == len(SHAPE_KEYS)  # the walk sees reads at all
    reads = [
        r
        for d in PLANNER
        for p in sorted((REPO / d).rglob("*.py"))
        if p != shape_py
        for r in _shape_key_reads(p)
    ]
    assert reads == []


def test_the_shape_is_what_the_config_says():
    shape = ModelShape.from_config(catalog.model("deepseek-v2-lite").config)
    assert (shape.layers, shape.dense_layers, shape.moe_layers) == (27, 1, 26)
    assert (shape.routed_experts, shape.active_experts, shape.shared_experts) == (64, 6, 2)
    assert shape.mla and shape.q_lora_rank == 0 and shape.head_dims == (192, 128)
    mha = ModelShape.from_config(catalog.model("deepseek-moe-16b").config)
    assert not mha.mla and mha.head_dims == (mha.hidden // mha.heads,) * 2
