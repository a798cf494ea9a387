"""The empty-value rule (dskit/spec/values.py BLANK), walked over the spec rather than listed: every field
of every section (list items' sections included), and every CLI flag that maps to one (SPEC_FLAGS),
refuses an empty or whitespace-only value in one line naming the field, instead of planning its default.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from dskit import cli
from dskit.cli.args import SPEC_FLAGS
from dskit.errors import SpecError
from dskit.spec import Spec, load_spec, validate_spec
from dskit.spec.values import BLANK, BLANK_INSIDE

BLANKS = ["", " ", "\t "]
TINY = ["--gpu", "cpu", "--gpus-per-node", "2", "--model", "tiny-v2", "--set", "training.seq_len=128"]


def _models(annotation: object) -> list[type[BaseModel]]:
    """The sections an annotation holds: X, X | None, list[X]."""
    args = typing.get_args(annotation) or (annotation,)
    found = []
    for a in args:
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
        elif typing.get_origin(a) is list or isinstance(a, types.GenericAlias):
            found += _models(a)
    return found


def _sample(annotation: object) -> object:
    """A valid value for a required field of a list item's section (DataSource.path, .weight)."""
    args = typing.get_args(annotation) or (annotation,)
    return 1.0 if float in args else 1 if int in args else "x"


def _item(model: type[BaseModel]) -> dict:
    return {n: _sample(f.annotation) for n, f in model.model_fields.items() if f.is_required()}


def leaves(model: type[BaseModel] = Spec, prefix: tuple = ()) -> list[tuple[tuple, dict]]:
    """Every field of the spec: (its location as the error reports it, the spec data that sets it to
    BLANK_MARK). A section is a field too; a list of sections is walked through its first item."""
    out = []
    for name, f in model.model_fields.items():
        loc = (*prefix, name)
        out.append((loc, _nest(loc, MARK)))
        for sub in _models(f.annotation):
            if typing.get_origin(f.annotation) is list or list in [
                typing.get_origin(a) for a in typing.get_args(f.annotation)
            ]:
                for sub_loc, _ in leaves(sub, ()):
                    item = {**_item(sub), sub_loc[0]: MARK} if len(sub_loc) == 1 else None
                    if item is not None:
                        out.append(((*loc, 0, *sub_loc), _nest(loc, [item])))
            else:
                out += leaves(sub, loc)
    return out


MARK = object()


def _nest(loc: tuple, value: object) -> dict:
    data: dict = {}
    node = data
    for part in loc[:-1]:
        node = node.setdefault(part, {})
    node[loc[-1]] = value
    return data


def _fill(data: object, blank: str) -> object:
    if data is MARK:
        return blank
    if isinstance(data, dict):
        return {k: _fill(v, blank) for k, v in data.items()}
    if isinstance(data, list):
        return [_fill(v, blank) for v in data]
    return data


LEAVES = leaves()
IDS = [".".join(map(str, loc)) for loc, _ in LEAVES]


def test_the_walk_reaches_every_section_and_list_item():
    names = set(IDS)
    # the fields, a list item's field, a nested section's field: the walk is not shallow
    assert {"model.path", "model.preset", "data.sources.0.path", "kubernetes.tolerations.0.value"} <= names
    assert {"finetune.lora.targets", "hardware.calibration", "storage.checkpoint_dir"} <= names
    assert len(LEAVES) > 100


@pytest.mark.parametrize("blank", BLANKS, ids=repr)
@pytest.mark.parametrize(("loc", "data"), LEAVES, ids=IDS)
def test_every_field_refuses_an_empty_value_naming_itself(loc, data, blank):
    with pytest.raises(SpecError) as e:
        validate_spec(_fill(data, blank))
    assert e.value.field == ".".join(map(str, loc))
    assert e.value.message == BLANK


SET_FIELDS = [(loc, d) for loc, d in LEAVES if 0 not in loc]


@pytest.mark.parametrize("blank", BLANKS, ids=repr)
@pytest.mark.parametrize("loc", [loc for loc, _ in SET_FIELDS], ids=".".join)
def test_every_field_refuses_an_empty_set(loc, blank):
    key = ".".join(loc)
    with pytest.raises(SpecError) as e:
        load_spec(None, [f"{key}={blank}"])
    assert (e.value.field, e.value.message) == (key, BLANK)


def _lists_of_text() -> list[str]:
    """The fields holding a list (or mapping) of strings: an empty item or key inside is refused too."""
    out = []
    for loc, _ in SET_FIELDS:
        model = Spec
        for part in loc[:-1]:
            model = _models(model.model_fields[part].annotation)[0]
        ann = model.model_fields[loc[-1]].annotation
        if typing.get_origin(ann) in (list, dict) and str in typing.get_args(ann):
            out.append(".".join(loc))
    return out


@pytest.mark.parametrize("blank", BLANKS, ids=repr)
@pytest.mark.parametrize("key", _lists_of_text())
def test_an_empty_item_or_key_inside_a_list_or_mapping_is_refused(key, blank):
    model = Spec
    *parents, last = key.split(".")
    for part in parents:
        model = _models(model.model_fields[part].annotation)[0]
    is_list = typing.get_origin(model.model_fields[last].annotation) is list
    value = [blank] if is_list else {blank: "v"}
    with pytest.raises(SpecError) as e:
        validate_spec(_nest(tuple(key.split(".")), value))
    assert (e.value.field, e.value.message) == (key, BLANK_INSIDE[list if is_list else dict])


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("blank", BLANKS, ids=repr)
@pytest.mark.parametrize("dest", sorted(SPEC_FLAGS))
def test_every_spec_flag_refuses_an_empty_value_in_one_line(tmp_path, monkeypatch, capsys, dest, blank):
    """`--model "$MODEL"` with MODEL unset: exit 2, one line naming the field (or the flag, for the
    integer flags argparse reads), and no run directory."""
    monkeypatch.chdir(tmp_path)
    key = SPEC_FLAGS[dest][0]
    flag = "--" + dest.replace("_", "-")
    args = list(TINY)
    if flag in args:  # the flag under test replaces the same flag of the tiny setup
        i = args.index(flag)
        del args[i : i + 2]
    before = _snapshot(tmp_path)
    try:
        code = cli.main(["render", "slurm", *args, flag, blank, "-o", str(tmp_path / "out")])
    except SystemExit as e:  # argparse's own refusal of a non-integer
        code = e.code
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("dskit: error: ") and (f"{key}: {BLANK}" in lines[0] or flag in lines[0])
    assert _snapshot(tmp_path) == before


def test_an_empty_preset_over_a_spec_that_names_one_is_refused(tmp_path):
    """The issue's second case: `--set model.preset=` must not fall back to the default model."""
    f = tmp_path / "s.yaml"
    f.write_text("model: {preset: tiny-v2}\n")
    with pytest.raises(SpecError) as e:
        load_spec(f, ["model.preset="])
    assert str(e.value) == f"model.preset: {BLANK}"
    assert load_spec(f, ["model.preset=null"]).model.preset is None  # null still asks for the default
