"""The spec's `tracking` section (dskit/spec/tracking.py): bad values in its fields are one line, exit 2,
nothing written, and a refused URI is never echoed (it may hold a credential); credentials in the
environment never reach a rendered file, on any target; run.yaml records the trackers with their
names resolved, and leaves the section out when TensorBoard alone is on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dskit import cli
from dskit.render import TARGETS

TINY = ["--gpu", "cpu", "--gpus-per-node", "2", "--model", "tiny-v2", "--set", "training.seq_len=128"]
SECRET = "sentinel-s3cret-7f3a9c"

# (--set expression, words the one line must hold)
BAD = {
    "credentials in the URI": (f"tracking.mlflow.tracking_uri=https://me:{SECRET}@mlflow:5000", "must not carry credentials"),
    "a token in the query": (f"tracking.mlflow.tracking_uri=https://mlflow/?token={SECRET}", "query or fragment"),
    "a fragment": (f"tracking.mlflow.tracking_uri=https://mlflow/#{SECRET}", "query or fragment"),
    "a file store": ("tracking.mlflow.tracking_uri=file:///tmp/mlruns", "is not an http:// or https:// URI"),
    "a database URI": (f"tracking.mlflow.tracking_uri=postgresql://u:{SECRET}@db/mlflow", "is not an http:// or https://"),
    "no scheme": ("tracking.mlflow.tracking_uri=mlflow:5000", "is not an http:// or https:// URI"),
    "shell in the path": ("tracking.mlflow.tracking_uri=http://mlflow/$(touch pwned)", "is not http(s)://HOST"),
    "a space": ("tracking.mlflow.tracking_uri=http://ml flow", "is not http(s)://HOST"),
    "port 0": ("tracking.mlflow.tracking_uri=http://mlflow:0", "the port must be 1-65535"),
    "a newline": ("tracking.mlflow.tracking_uri=http://mlflow\n", "control characters"),
    "a line separator": ("tracking.wandb.project=p\u2028q", "control characters"),
    "empty URI": ("tracking.mlflow.tracking_uri=", "is empty"),
    "blank experiment": ("tracking.mlflow.experiment= ", "is empty"),
    "experiment with a space": ("tracking.mlflow.experiment=my run", "must be 1-128 letters"),
    "experiment climbing out": ("tracking.mlflow.experiment=../x", "must be 1-128 letters"),
    "run name with a dollar": ("tracking.mlflow.run_name=$(id)", "must be 1-128 letters"),
    "run name too long": ("tracking.mlflow.run_name=" + "x" * 129, "must be 1-128 letters"),
    "project with a slash": ("tracking.wandb.project=team/p", "must be 1-128 letters"),
    "project with shell": ("tracking.wandb.project=p;rm", "must be 1-128 letters"),
    "entity non-ASCII": ("tracking.wandb.entity=équipe", "must be 1-128 letters"),
    "unknown mode": ("tracking.wandb.mode=disabled", "'online' or 'offline'"),
    "unknown key": ("tracking.wandb.api_key=x", "unknown key 'api_key'"),
    "tensorboard not a bool": ("tracking.tensorboard=maybe", "tracking.tensorboard"),
    "a tracker not a mapping": ("tracking.mlflow=5", "tracking.mlflow"),
}  # fmt: skip


def snapshot(d: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tracking_values_are_one_line_exit_2_nothing_written(case, tmp_path, monkeypatch, capsys):
    expr, words = BAD[case]
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    rc = cli.main(["render", "slurm", *TINY, "--set", expr, "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dskit: error: tracking."), err
    assert words in lines[0], lines[0]
    assert SECRET not in err
    assert snapshot(tmp_path) == before


def test_a_spec_file_with_credentials_in_the_uri_is_refused_without_echoing_them(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"tracking": {"mlflow": {"tracking_uri": f"http://u:{SECRET}@h"}}}))
    assert cli.main(["render", "slurm", str(spec), *TINY, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dskit: error: tracking.mlflow.tracking_uri: must not carry credentials")
    assert SECRET not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["slurm", "helm", "ray"])
def test_no_credential_reaches_a_rendered_file(target, tmp_path, monkeypatch, capsys):
    for var in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY", "HF_TOKEN"):
        monkeypatch.setenv(var, f"{SECRET}-{var}")
    out = tmp_path / "out"
    sets = [
        "tracking.mlflow.tracking_uri=https://mlflow.internal:5000/prefix",
        "tracking.wandb.entity=team",
        "kubernetes.secret_env={WANDB_API_KEY: wandb/api-key, MLFLOW_TRACKING_TOKEN: mlflow/token}",
    ]
    args = ["render", target, *TINY, "-o", str(out), *(w for s in sets for w in ("--set", s))]
    assert cli.main(args) == 0, capsys.readouterr().err
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and TARGETS[target]
    for p in files:
        assert SECRET.encode() not in p.read_bytes(), p
    plan = yaml.safe_load((out / "run.yaml").read_text())
    assert plan["tracking"] == {
        "tensorboard": True,
        "mlflow": {"tracking_uri": "https://mlflow.internal:5000/prefix", "experiment": "dskit-run", "run_name": "dskit-run"},
        "wandb": {"project": "dskit-run", "entity": "team", "mode": "online"},
    }  # fmt: skip
    if target == "helm":  # by reference: the chart renders each as valueFrom.secretKeyRef
        values = yaml.safe_load((out / "values.yaml").read_text())
        assert {"name": "WANDB_API_KEY", "secretName": "wandb", "key": "api-key"} in values["trainer"][
            "secretEnv"
        ]


def test_tensorboard_alone_leaves_run_yaml_as_before(tmp_path, capsys):
    assert cli.main(["render", "slurm", *TINY, "-o", str(tmp_path / "a")]) == 0
    off = ["--set", "tracking.tensorboard=false"]
    assert cli.main(["render", "slurm", *TINY, *off, "-o", str(tmp_path / "b")]) == 0
    a = yaml.safe_load((tmp_path / "a" / "run.yaml").read_text())
    b = yaml.safe_load((tmp_path / "b" / "run.yaml").read_text())
    assert "tracking" not in a and "tracking" not in a["spec"]
    assert b["tracking"] == {"tensorboard": False, "mlflow": None, "wandb": None}


def test_an_empty_mapping_turns_a_tracker_on_with_its_defaults(tmp_path, capsys):
    args = [
        "render",
        "slurm",
        *TINY,
        "--set",
        "tracking.wandb={}",
        "--set",
        "name=exp-1",
        "-o",
        str(tmp_path / "o"),
    ]
    assert cli.main(args) == 0
    plan = yaml.safe_load((tmp_path / "o" / "run.yaml").read_text())
    assert plan["tracking"]["wandb"] == {"project": "exp-1", "entity": None, "mode": "online"}
    assert plan["tracking"]["mlflow"] is None
