"""Images: images/ is current, hadolint- and shellcheck-clean, and `dskit render image` / `dskit build
image` behave (the latter with a stub engine). The install script run for real, the CUDA locks resolved
and the CPU image built: tests/e2e/test_image_install.py and tests/e2e/test_image_build.py (marker
`image`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dskit import catalog
from dskit.render import image
from tests.conftest import REPO, dskit
from tests.support.cli import cli

IMAGES = REPO / "images"
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


def test_images_dir_is_current():
    want = image.catalog_images()
    assert sorted(p.name for p in IMAGES.iterdir()) == sorted(want), "run `make examples`"
    for name, files in want.items():
        for rel, text in files.items():
            assert (IMAGES / name / rel).read_text() == text, (
                f"images/{name}/{rel} is stale: run `make examples`"
            )


def test_every_gpu_has_an_image_for_its_arch():
    for g in catalog.gpus().values():
        d = IMAGES / g.name
        docker = (d / "Dockerfile").read_text()
        if g.is_cpu:
            assert "TORCH_CUDA_ARCH_LIST" not in docker
            continue
        assert f'TORCH_CUDA_ARCH_LIST="{g.compute_capability}"' in docker  # no "9.0a"
        install = (d / "install.sh").read_text()
        # FlashAttention-2 compiled for sm80 only where it is the kernel; Hopper compiles no attention
        assert ("flash-attn==" in install) == (g.flash_attn == "fa2")
        assert ('FLASH_ATTN_CUDA_ARCHS="80"' in docker) == (g.flash_attn == "fa2")
        assert ("'flash-attn-4[cu13]==" in install) == (g.flash_attn == "fa4")
        assert f'DSKIT_IMAGE_FLASH_ATTN="{g.flash_attn}"' in docker
        assert "rdma-core" in docker and "dskit doctor --build" in docker
    assert "efa_installer.sh" in (IMAGES / "h100-80gb-efa" / "Dockerfile").read_text()
    assert "cu12.6" in image.image_tag(catalog.gpu("v100-32gb"), "infiniband")  # CUDA 13 has no sm70


@pytest.mark.parametrize("name", sorted(p.name for p in IMAGES.iterdir()))
def test_dockerfiles_are_hadolint_clean(name):
    r = subprocess.run([HADOLINT, str(IMAGES / name / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", sorted(p.name for p in IMAGES.iterdir()))
def test_install_scripts_are_shellcheck_clean(name):
    sc = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    for f in ("install.sh", "enroot-import.sh"):
        r = subprocess.run([sc, str(IMAGES / name / f)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


def test_render_image_cli(tmp_path):
    out = tmp_path / "img"
    r = cli("render", "image", "--gpu", "a100-80gb", "--fabric", "efa", "-o", str(out), check=True)
    assert "docker build -f" in r.stdout and "efa" in r.stdout
    assert (out / "Dockerfile").is_file() and os.access(out / "install.sh", os.X_OK)
    bad = cli("render", "image", "--gpu", "a100", "-o", str(tmp_path / "x"))
    assert bad.returncode == 2 and "hardware.gpu" in bad.stderr and not (tmp_path / "x").exists()


def _dockerfile_copies_of_sources(text: str) -> list[str]:
    """The sources the Dockerfile copies into the wheel's build directory (`COPY SRC /tmp/dskit-src/...`)."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and words[-1].startswith(image.SRC_DIR):
            assert words[-1] == f"{image.SRC_DIR}/{words[1]}", line  # same layout as the repository
            out += words[1:-1]
    return out


def test_images_copy_what_the_wheel_build_reads():
    """pyproject.toml decides what `pip install /tmp/dskit-src` reads: the readme, the wheel's packages and
    its force-include sources. Each must be copied, or the image build fails (it once lacked helm/dskit)."""
    tomllib = pytest.importorskip("tomllib")
    py = tomllib.loads((REPO / "pyproject.toml").read_text())
    wheel = py["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = {"pyproject.toml", py["project"]["readme"], *wheel["packages"], *wheel.get("force-include", {})}
    assert set(image.WHEEL_SOURCES) == needed
    for name in sorted(p.name for p in IMAGES.iterdir()):
        copied = _dockerfile_copies_of_sources((IMAGES / name / "Dockerfile").read_text())
        assert sorted(copied) == sorted(needed), name
        assert all((REPO / src).exists() for src in copied)


def test_base_images_are_build_arguments():
    for name in sorted(p.name for p in IMAGES.iterdir()):
        text = (IMAGES / name / "Dockerfile").read_text()
        froms = [line for line in text.splitlines() if line.startswith("FROM ")]
        assert froms == ["FROM ${BUILDER_IMAGE} AS builder", "FROM ${RUNTIME_IMAGE}"], name
        tc = image.toolchains()[image.toolchain_for(catalog.gpu(name.removesuffix("-efa")))]
        assert f'ARG BUILDER_IMAGE="{tc["builder_image"]}"' in text  # the public base by default
        assert f'ARG RUNTIME_IMAGE="{tc["runtime_image"]}"' in text
        assert "# syntax=" not in text  # BuildKit would pull its frontend image from a registry


def test_install_scripts_compile_ops_for_the_stated_isa():
    for name in sorted(p.name for p in IMAGES.iterdir()):
        install = (IMAGES / name / "install.sh").read_text()
        assert f"isa=${{DSKIT_CPU_ISA:-{image.CPU_ISA}}}" in install
        assert "-march=native) args+=(-march=$isa)" in install
        assert f'ARG DSKIT_CPU_ISA="{image.CPU_ISA}"' in (IMAGES / name / "Dockerfile").read_text()


def _stub_engine(d: Path, name: str = "podman") -> Path:
    """A stand-in engine: records its argv and the build context's files, reports a 1 GiB image."""
    d.mkdir()
    log = d / "calls.jsonl"
    stub = d / name
    stub.write_text(
        f"""#!{sys.executable}
import json, os, sys
with open({str(log)!r}, "a") as f:
    files = sorted(os.path.relpath(os.path.join(r, n)) for r, _, ns in os.walk(".") for n in ns)
    f.write(json.dumps({{"argv": sys.argv[1:], "files": files}}) + "\\n")
if sys.argv[1:3] == ["image", "inspect"]:
    print(json.dumps([{{"Size": 2**30}}]))
"""
    )
    stub.chmod(0o755)
    return log


def test_build_image_cli_with_a_stub_engine(tmp_path):
    log = _stub_engine(tmp_path / "bin")
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    # the console script's process, once for `dskit build` (its other tests run its main in this one)
    r = dskit("build", "image", "--gpu", "cpu", "--build-arg", "BUILDER_IMAGE=local/base:1", env=env)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(
        r"built dskit:cpu-torch2\.13\.0-cpu-ds0\.19\.8 with podman in \d+s \(\d+ s\): 1\.00 GiB\n", r.stdout
    )
    build, inspect = [json.loads(line) for line in log.read_text().splitlines()]
    assert build["argv"][:2] == ["build", "--format=docker"] and build["argv"][-1] == "."
    assert "BUILDER_IMAGE=local/base:1" in build["argv"] and "images/cpu/Dockerfile" in build["argv"]
    # the context holds what the Dockerfile copies, and nothing else (no .venv, runs/, .git)
    tops = {f.split("/")[0] for f in build["files"]}
    assert tops == {"pyproject.toml", "README.md", "dskit", "templates", "helm", "images"}
    assert "helm/dskit/Chart.yaml" in build["files"] and not any("__pycache__" in f for f in build["files"])
    assert sorted(f for f in build["files"] if f.startswith("images/")) == sorted(
        f"images/cpu/{n}" for n in image.image_files("cpu")
    )
    assert inspect["argv"][:2] == ["image", "inspect"]


@pytest.mark.parametrize(
    "args, field",
    [
        (["--gpu", "h100"], "--gpu"),
        (["--gpu", "cpu", "--engine", "rkt"], "--engine"),
        (["--gpu", "cpu", "--build-arg", "no-equals"], "--build-arg"),
        (["--gpu", "cpu", "--tag", "-rm x"], "--tag"),
        (["--gpu", "cpu"], "--engine"),  # no engine on PATH
    ],
)
def test_build_image_bad_input_is_one_line(tmp_path, args, field):
    (tmp_path / "bin").mkdir()
    r = cli("build", "image", *args, env={"PATH": str(tmp_path / "bin")})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"dskit: error: {field}:") and r.stderr.count("\n") == 1, r.stderr


def test_build_image_reports_a_failed_build(tmp_path):
    log = _stub_engine(tmp_path / "bin")
    stub = tmp_path / "bin" / "podman"
    stub.write_text(stub.read_text() + "sys.exit(3)\n")
    r = cli("build", "image", "--gpu", "cpu", env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    assert r.returncode == 1 and "podman build exited 3" in r.stderr
    assert len(log.read_text().splitlines()) == 1  # no size asked of a failed build
