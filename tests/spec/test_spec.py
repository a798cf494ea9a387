"""The run spec: validation, overrides, errors that name the field, the schema and the starter file."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from dskit.errors import SpecError
from dskit.spec import Spec, json_schema, load_spec, parse_set, starter_yaml
from tests.support.cli import cli


def test_defaults_are_the_documented_default_job():
    s = load_spec()
    assert (s.hardware.gpu, s.hardware.gpus_per_node, s.network.fabric, s.runtime.kind) == (
        "h100-80gb",
        8,
        "infiniband",
        "pyxis",
    )
    assert s.training.lr == 1.5e-4 and s.training.warmup_ratio == 0.03


def test_set_overrides_keep_types_and_reach_nested_fields():
    s = load_spec(sets=["training.steps=7", "training.lr=1e-3", "runtime.mounts=[/a:/a, /b:/b]"])
    assert s.training.steps == 7 and s.training.lr == 1e-3 and s.runtime.mounts == ["/a:/a", "/b:/b"]


def test_cli_flags_win_over_set_and_file(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("hardware: {nodes: 3}\n")
    s = load_spec(f, sets=["hardware.nodes=4"], flags={"hardware.nodes": 2})
    assert s.hardware.nodes == 2


@pytest.mark.parametrize(
    ("sets", "field", "words"),
    [
        (["hardware.nodes=0"], "hardware.nodes", "greater than or equal to 1"),
        (["hardware.nodez=2"], "hardware.nodez", "valid keys: gpu, gpus_per_node, nodes"),
        (["runtime.kind=docker"], "runtime.kind", "'pyxis', 'apptainer' or 'none'"),
        (["name=Bad Name"], "name", "lowercase"),
        (["slurm.time=forever"], "slurm.time", "HH:MM:SS"),
        (["slurm.extra_args=['--comment=$(id)']"], "slurm.extra_args", "no spaces, quotes or $"),
        (["storage.root=/a\nb"], "storage.root", "control characters"),
        (["training.steps=many"], "training.steps", "integer"),
    ],
)
def test_bad_values_name_the_field(sets, field, words):
    with pytest.raises(SpecError) as e:
        load_spec(sets=sets)
    assert e.value.field == field
    assert words in e.value.message


def test_model_preset_and_path_are_exclusive(tmp_path):
    with pytest.raises(SpecError, match="either model.preset or model.path"):
        load_spec(sets=["model.preset=tiny-v2", f"model.path={tmp_path}"])


def test_set_without_equals_is_rejected():
    with pytest.raises(SpecError) as e:
        parse_set("training.steps")
    assert e.value.field == "--set"


def test_starter_file_is_valid_yaml_equal_to_the_defaults():
    data = yaml.safe_load(starter_yaml())
    assert Spec.model_validate(data) == Spec()
    jsonschema.validate(data, json_schema())


def test_schema_rejects_what_validation_rejects():
    schema = json_schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"hardware": {"nodes": 0}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"bogus": 1}, schema)


def test_cli_schema_and_init(tmp_path):
    out = cli("schema", check=True)
    assert json.loads(out.stdout)["title"] == "dskit run spec"
    cli("init", "-o", str(tmp_path / "s.yaml"), check=True)
    assert cli("plan", str(tmp_path / "s.yaml")).returncode == 0
    # `-o -`: the same file on stdout, and no file named "-"
    assert cli("init", "-o", "-", check=True).stdout == (tmp_path / "s.yaml").read_text()
    assert not Path("-").exists()
    again = cli("init", "-o", str(tmp_path / "s.yaml"))
    assert again.returncode == 2 and "already exists" in again.stderr
