"""Images: images/ is current and hadolint-clean, the CPU install script really installs (DeepSpeed's
CPU ops built, not JIT), and the CUDA locks resolve against the package index.

No Docker engine exists on the development/CI machines, so images are not built here; every part that
can run without one does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import yaml

from dskit import catalog
from dskit.render import image
from tests.conftest import REPO, dskit

IMAGES = REPO / "images"
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
# cp312 manylinux x86_64, every glibc level pip knows: the platform the CUDA images install on
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    a
    for t in ["manylinux2014_x86_64", "manylinux1_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(5, 40))]
    for a in ("--platform", t)
]


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


# Registers above x86-64-v3 (AVX2): AVX-512's zmm and opmask registers, AMX's tiles. What -march=native
# leaves behind on an AVX-512 host (DeepSpeed's -D__AVX512__ kernels use zmm throughout). EVEX-encoded
# xmm/ymm instructions (AVX-512VL) are not detected this way; -march=x86-64-v3 cannot emit them.
ABOVE_V3 = re.compile(r"%zmm\d+|%k[0-7]\b|%tmm\d+")
# Functions DeepSpeed itself compiles for AVX-512 whatever -march says (__attribute__((target("avx512bw")))
# in csrc/cpu/comm/x86_64/shm.h) and runs only when vector_kernel_level() finds AVX-512BW at run time
# (shm_interface.cpp; inference_all_reduce, not training's collectives): allowed in the shm op.
RUNTIME_DISPATCHED = {
    "deepspeed_shm_comm": (
        "reduce_bf16_buffers(",
        "reduce_fp16_buffers(",
        "reduce_fp32_buffers(",
        "parallel_memcpy(",
    ),
}


def instructions_above_v3(so: Path) -> dict[str, int]:
    """{function: count} of SO's instructions that use registers x86-64-v3 does not have."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) not installed")
    out = subprocess.run(
        [objdump, "-d", "-C", "--no-show-raw-insn", str(so)], capture_output=True, text=True, check=True
    )
    found: dict[str, int] = {}
    fn = "?"
    for line in out.stdout.splitlines():
        if line.endswith(">:") and " <" in line:
            fn = line.split(" <", 1)[1][:-2]
        elif ABOVE_V3.search(line):
            found[fn] = found.get(fn, 0) + 1
    return found


def check_ops_within_v3(site_packages: Path) -> list[str]:
    """DeepSpeed's compiled ops under SITE_PACKAGES: within x86-64-v3 except DeepSpeed's own runtime-
    dispatched AVX-512 kernels, and AVX2 code present in cpu_adam (the baseline's SIMD kernels, not a
    scalar fallback). Returns the .so names checked."""
    sos = sorted((site_packages / "deepspeed").rglob("*.so"))
    assert sos, f"no compiled DeepSpeed ops under {site_packages}"
    for so in sos:
        allowed = next((fns for op, fns in RUNTIME_DISPATCHED.items() if so.name.startswith(op)), ())
        above = {fn: n for fn, n in instructions_above_v3(so).items() if not fn.startswith(allowed or "\0")}
        assert not above, f"{so.name}: instructions above x86-64-v3 in {above}"
    adam = [so for so in sos if so.name.startswith("cpu_adam")]
    assert adam, [so.name for so in sos]
    dis = subprocess.run(["objdump", "-d", str(adam[0])], capture_output=True, text=True).stdout
    assert "%ymm" in dis, "cpu_adam has no AVX2 code: built scalar?"
    return [so.name for so in sos]


@pytest.mark.network
@pytest.mark.slow
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


@pytest.mark.network
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


def test_render_image_cli(tmp_path):
    out = tmp_path / "img"
    r = dskit("render", "image", "--gpu", "a100-80gb", "--fabric", "efa", "-o", str(out), check=True)
    assert "docker build -f" in r.stdout and "efa" in r.stdout
    assert (out / "Dockerfile").is_file() and os.access(out / "install.sh", os.X_OK)
    bad = dskit("render", "image", "--gpu", "a100", "-o", str(tmp_path / "x"))
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
    r = dskit("build", "image", *args, env={"PATH": str(tmp_path / "bin")})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"dskit: error: {field}:") and r.stderr.count("\n") == 1, r.stderr


def test_build_image_reports_a_failed_build(tmp_path):
    log = _stub_engine(tmp_path / "bin")
    stub = tmp_path / "bin" / "podman"
    stub.write_text(stub.read_text() + "sys.exit(3)\n")
    r = dskit("build", "image", "--gpu", "cpu", env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    assert r.returncode == 1 and "podman build exited 3" in r.stderr
    assert len(log.read_text().splitlines()) == 1  # no size asked of a failed build
