"""The wheel ships the templates and renders without torch, from a clean virtual environment. It is built
from the images' build context (what their Dockerfiles copy), so a source the wheel needs but the image
lacks fails here: pyproject's force-include of helm/dskit once broke every image build."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from dskit.host.image_builder import make_context
from dskit.plan.build import build_plan
from dskit.render import slurm
from dskit.spec import load_spec
from tests.conftest import REPO

# builds the wheel (pip fetches the build backend) and installs its dependencies into a fresh venv
pytestmark = [pytest.mark.network, pytest.mark.slow]


def test_wheel_installs_and_renders_in_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    ctx = tmp_path / "context"
    make_context(ctx, "cpu", "tcp")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ctx)],
        check=True,
        capture_output=True,
    )
    wheel = next(dist.glob("dskit-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "dskit/templates/slurm/job.sbatch.j2" in names
    assert "dskit/catalog/models.yaml" in names
    assert "dskit/chart/templates/job.yaml" in names and "dskit/chart/values.schema.json" in names

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True)
    out = tmp_path / "job"
    r = subprocess.run(
        [str(env_dir / "bin" / "dskit"), "render", "slurm", "--nodes", "2", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    want = slurm.render(build_plan(load_spec(flags={"hardware.nodes": 2})), out)
    assert (out / "job.sbatch").read_text() == want["job.sbatch"]
    no_torch = subprocess.run([str(py), "-c", "import torch"], capture_output=True)
    assert no_torch.returncode != 0  # the core install stays light: no torch came with it
    assert Path(out / "run.yaml").is_file()
    # the chart travels inside the wheel and into the run dir
    helm_out = tmp_path / "helm"
    r = subprocess.run(
        [str(env_dir / "bin" / "dskit"), "render", "helm", "-o", str(helm_out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert (helm_out / "chart" / "files" / "launch.sh").read_text() == (
        REPO / "helm" / "dskit" / "files" / "launch.sh"
    ).read_text()
