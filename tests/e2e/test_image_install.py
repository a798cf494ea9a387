"""What the images install, without a container engine: the CPU image's own install script in a fresh
venv (pins resolve, DeepSpeed's CPU ops compiled at install time within x86-64-v3), and the CUDA images'
locks resolved by pip against the package index.

Marker `image`, with the image build (tests/e2e/test_image_build.py): they verify the image inputs
(tests/support/image_gate.py), so `make test` runs them where those changed since they last passed, and
the scheduled run always (docs/development.md "Image tests").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv

import pytest
import yaml

from dskit.render import image
from tests.conftest import REPO
from tests.support.isa import check_ops_within_v3

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.network]

IMAGES = REPO / "images"
# cp312 manylinux x86_64, every glibc level pip knows: the platform the CUDA images install on
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    a
    for t in ["manylinux2014_x86_64", "manylinux1_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(5, 40))]
    for a in ("--platform", t)
]


def test_cpu_install_script_installs_and_prebuilds_deepspeed_ops(tmp_path):
    """The same file the CPU Dockerfile runs, in a fresh venv: pins resolve, CPU ops are compiled."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    env = {**os.environ, "PYTHON": str(py), "DSKIT_TORCH_INDEX": ""}  # CI reaches PyPI only
    env.pop("PIP_REQUIRE_VIRTUALENV", None)
    r = subprocess.run(["bash", str(IMAGES / "cpu" / "install.sh")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lock = yaml.safe_load((REPO / "dskit" / "catalog" / "images.yaml").read_text())["cpu"]
    code = (
        "import torch, deepspeed, transformers, json; from deepspeed.git_version_info import installed_ops; "
        "print(json.dumps([torch.__version__, deepspeed.__version__, transformers.__version__, "
        "installed_ops['cpu_adam'], installed_ops['deepspeed_shm_comm']]))"
    )
    out = subprocess.run(
        [str(py), "-c", code], capture_output=True, text=True, env={**env, "DS_ACCELERATOR": "cpu"}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    tv, dv, trv, cpu_adam, shm = json.loads(out.stdout.strip().splitlines()[-1])
    assert (
        tv.split("+")[0] == lock["torch"]
        and dv == lock["pins"]["deepspeed"]
        and trv == lock["pins"]["transformers"]
    )
    assert cpu_adam and shm  # compiled at install time: no JIT at worker start
    # ...for x86-64-v3, although this host may have AVX-512 (where -march=native would use it)
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    check_ops_within_v3(site)


@pytest.mark.parametrize("toolchain", ["cu130", "cu126"])
def test_cuda_locks_resolve_against_the_index(toolchain, tmp_path):
    """pip's resolver, run for the images' platform with --dry-run: it reads wheel metadata from the
    index (PEP 658) and downloads no multi-GB wheels. DeepSpeed and flash-attn ship as sdists (built in the
    image against the installed torch), so for them the test checks that the pinned version is on the index."""
    tc = image.toolchains()[toolchain]
    reqs = [f"torch=={tc['torch']}"] + [f"{k}=={v}" for k, v in tc["pins"].items() if k != "deepspeed"]
    # the Hopper images' FlashAttention-4 lock resolves with the rest (pip installs it on top of it)
    reqs += [f"{k}=={v}" for k, v in (tc.get("flash_attn_4") or {}).items()]
    report = tmp_path / "report.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--target",
            str(tmp_path / "t"),
            *PLATFORM,
            *reqs,
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = {  # PEP 503 names: metadata spells some with underscores (torch_c_dlpack_ext)
        re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    assert got["torch"] == tc["torch"]
    for req, version in (tc.get("flash_attn_4") or {}).items():
        assert got[req.split("[")[0]] == version, req
    cuda_major = tc["cuda"].split(".")[0]
    assert any(n.startswith("nvidia-cuda-runtime") and v.startswith(cuda_major) for n, v in got.items()), got
    sdists = {"deepspeed": tc["pins"]["deepspeed"]} | (
        {"flash-attn": tc["flash_attn"]} if tc["flash_attn"] else {}
    )
    for name, version in sdists.items():
        r = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True
        )
        listed = r.stdout.split("Available versions:")[-1].replace(",", " ").split()
        assert version in listed, f"{name}=={version} not on the index: {r.stdout[:300]}"
