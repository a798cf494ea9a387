"""A core install (no extra: no torch, DeepSpeed, matplotlib) renders jobs, and every command that needs an
extra refuses in one line naming it, exit 2, before it writes anything: through the one guard,
dskit/host/extras.py."""

from __future__ import annotations

import importlib.metadata as metadata
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dskit.host.extras import MODULES
from tests.support import core_install

TINY = ["--gpu", "cpu", "--gpus-per-node", "2", "--model", "tiny-v2", "--set", "training.seq_len=128"]

#: every command that needs an extra: (the python's arguments, the command named, extra, first module missing)
NEEDS = {
    "dskit train": (["-m", "dskit", "train"], "train", "train", "torch"),
    "dskit train --local RUN": (["-m", "dskit", "train", "--local", "run"], "train", "train", "torch"),
    "dskit calibrate local": (
        ["-m", "dskit", "calibrate", "local", *TINY],
        "calibrate local",
        "train",
        "torch",
    ),
    "dskit export": (["-m", "dskit", "export", "run", "-o", "hf"], "export", "train", "torch"),
    "dskit data prepare": (
        ["-m", "dskit", "data", "prepare", "a.txt", "-o", "shards"],
        "data prepare",
        "train",
        "numpy",
    ),
    "dskit report": (["-m", "dskit", "report", "run"], "report", "report", "matplotlib"),
    "dskit plan --plot": (
        ["-m", "dskit", "plan", *TINY, "--plot", "p.png"],
        "plan --plot",
        "report",
        "matplotlib",
    ),
    "python -m dskit.host.jit_ops": (
        ["-m", "dskit.host.jit_ops"],
        "python -m dskit.host.jit_ops",
        "train",
        "torch",
    ),
    "python -m dskit.train": (["-m", "dskit.train"], "python -m dskit.train", "train", "torch"),
}


@pytest.fixture(scope="module")
def core_python(tmp_path_factory) -> Path:
    py = core_install.make(tmp_path_factory.mktemp("core") / "venv")
    assert not core_install.python_has(py, "torch") and not core_install.python_has(py, "matplotlib")
    return py


def _snapshot(d: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="module")
def core_run(core_python, tmp_path_factory) -> Path:
    """A rendered run, the input some of them read: the core install renders it (once for them all)."""
    d = tmp_path_factory.mktemp("rendered")
    rendered = subprocess.run(
        [
            str(core_python),
            "-m",
            "dskit",
            "render",
            "slurm",
            *TINY,
            "--set",
            f"storage.root={d}",
            "-o",
            "run",
        ],
        cwd=d,
        capture_output=True,
        text=True,
    )
    assert rendered.returncode == 0, rendered.stderr
    return d / "run"


@pytest.mark.parametrize("case", sorted(NEEDS))
def test_a_command_needing_an_extra_is_refused_in_one_line_in_a_core_install(
    core_python, core_run, tmp_path, case
):
    args, command, extra, module = NEEDS[case]
    shutil.copytree(core_run, tmp_path / "run")
    (tmp_path / "a.txt").write_text("some text")
    before = _snapshot(tmp_path)
    r = subprocess.run([str(core_python), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (2, ""), r.stderr[-2000:]
    assert r.stderr.splitlines() == [
        f"dskit: error: {command}: needs the {extra} extra (missing {module}): pip install 'dskit[{extra}]'"
    ]
    assert _snapshot(tmp_path) == before, "something was written"


def test_the_guard_checks_only_packages_its_extra_installs():
    requires = [Requirement(r) for r in metadata.requires("dskit") or []]
    for extra, modules in MODULES.items():
        installs = {r.name.lower() for r in requires if r.marker and r.marker.evaluate({"extra": extra})}
        assert set(modules) <= installs, (extra, set(modules) - installs)
