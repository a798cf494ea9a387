"""A core install of dskit (`pip install dskit`, no extra) made offline in a second or two: a fresh
virtual environment whose site-packages hold exactly the project's dependencies (pyproject.toml) and what
they require, linked from this interpreter's, and this checkout on its path. torch, DeepSpeed and the
other extras' packages are not in it, as on a laptop that only renders jobs. (tests/e2e/test_wheel.py
installs the built wheel from the package index instead: slow and online.)"""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sysconfig
import venv
from pathlib import Path

from packaging.requirements import Requirement

from tests.conftest import REPO


def core_distributions() -> set[str]:
    """The distributions of a core install: the project's dependencies and theirs, without extras (as
    installed here: `make setup` installs pyproject.toml's again when it changes)."""
    todo = list(metadata.requires("dskit") or [])
    seen: set[str] = set()
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name not in seen:
            seen.add(name)
            todo.extend(metadata.requires(name) or [])
    return seen


def make(root: Path) -> Path:
    """A core install under `root`; its python."""
    venv.create(root, with_pip=False, symlinks=True)
    py = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    here = Path(sysconfig.get_path("purelib"))
    for name in core_distributions():
        dist = metadata.distribution(name)
        base = Path(dist.locate_file(""))
        # each top-level entry of the distribution's files in site-packages: its packages, modules and
        # dist-info (console scripts and the like live outside, as ../../bin/...)
        tops = {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")} - {"__pycache__"}
        for top in tops:
            assert base == here, f"{name} is not installed in {here}"
            (site / top).symlink_to(base / top)
    (site / "dskit-checkout.pth").write_text(f"{REPO}\n")
    return py


def python_has(py: Path, module: str) -> bool:
    return subprocess.run([str(py), "-c", f"import {module}"], capture_output=True).returncode == 0
