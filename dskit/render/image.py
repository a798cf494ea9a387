"""Image target: GPU profile -> Dockerfile (multi-stage), its install script and version lock, plus the
enroot/pyxis import command and an apptainer definition for Slurm users.

Build from the repository root (the context holds dskit itself):
    docker build -f images/<gpu>/Dockerfile -t <tag printed in the Dockerfile> .
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml

from dskit import __version__, catalog
from dskit.plan.schema import Plan
from dskit.render.common import q, render_template, shell_words

# What `pip install /tmp/dskit-src` in the image reads, relative to the repository root: pyproject.toml's
# readme, the wheel's packages and its force-include sources (templates/ and the Helm chart).
# tests/render/test_images.py checks this against pyproject.toml and builds the wheel from exactly these paths.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "dskit", "templates", "helm/dskit")
SRC_DIR = "/tmp/dskit-src"

# The ISA DeepSpeed's CPU ops are compiled for (install.sh; DSKIT_CPU_ISA overrides it at build time).
# x86-64-v3 = AVX2, FMA, BMI2 (psABI microarchitecture levels): Intel Haswell (2013) and AMD Zen 1 on;
# every GPU server of the catalog's generations has it (DGX-1's Broadwell-EP included). Not v4: AVX-512
# is missing on AMD before Zen 4 and on Intel client CPUs.
CPU_ISA = "x86-64-v3"

# Values that go into the Dockerfile unquoted-by-shell (ARG defaults, FROM): image references, URLs.
_DOCKER_VALUE = re.compile(r"^[A-Za-z0-9._:/@+-]*$")

DOCKERFILE, INSTALL, LOCK, APPTAINER, ENROOT = (
    "Dockerfile",
    "install.sh",
    "requirements.lock",
    "apptainer.def",
    "enroot-import.sh",
)


@functools.cache
def toolchains() -> dict:
    return yaml.safe_load((Path(catalog.__file__).parent / "images.yaml").read_text())


def toolchain_for(gpu: catalog.GPU) -> str:
    if gpu.is_cpu:
        return "cpu"
    major, minor = (int(x) for x in gpu.compute_capability.split("."))
    return "cu130" if (major, minor) >= (7, 5) else "cu126"


def flash_attn_archs(gpu: catalog.GPU) -> str | None:
    """FLASH_ATTN_CUDA_ARCHS for FlashAttention-2's build, the only attention kernel an image compiles:
    sm80 code serves sm86/89 (same major). Hopper images install FlashAttention-4 instead."""
    return "80" if gpu.flash_attn == "fa2" else None


def flash_attn_version(gpu: catalog.GPU, tc: dict) -> str | None:
    """The FlashAttention release the image carries for `gpu`, or None."""
    if gpu.flash_attn == "fa2":
        return tc["flash_attn"]
    if gpu.flash_attn == "fa4" and tc["flash_attn_4"]:
        versions = {req.split("[")[0]: v for req, v in tc["flash_attn_4"].items()}
        return versions["flash-attn-4"]  # the lock's own entry, whatever extra it names
    return None


def image_tag(gpu: catalog.GPU, fabric: str) -> str:
    tc = toolchains()[toolchain_for(gpu)]
    parts = [gpu.name, f"torch{tc['torch']}", f"cu{tc['cuda']}" if tc["cuda"] else "cpu"]
    if fa := flash_attn_version(gpu, tc):
        parts.append(f"{gpu.flash_attn}-{fa}")
    parts.append(f"ds{tc['pins']['deepspeed']}")
    if fabric == "efa":
        parts.append("efa")
    return "dskit:" + "-".join(parts)


def plan_tag(plan: Plan) -> str:
    """The tag `dskit render image` prints for the plan's GPU and fabric."""
    return image_tag(catalog.gpu(plan.hardware.gpu, "--gpu"), plan.launch.fabric)


def render(plan: Plan, out_dir: Path) -> dict[str, str]:
    """The image for the plan's GPU and fabric (a CPU plan's fabric is tcp: no RDMA libraries)."""
    return image_files(plan.hardware.gpu, plan.launch.fabric)


def image_files(gpu_name: str, fabric_name: str = "infiniband") -> dict[str, str]:
    gpu = catalog.gpu(gpu_name, "--gpu")
    fab = catalog.fabric(fabric_name, "--fabric")
    if gpu.is_cpu and fab.rdma:
        fabric_name = "tcp"  # a CPU image has no use for RDMA libraries (catalog_images asks for them)
    tc_name = toolchain_for(gpu)
    tc = toolchains()[tc_name]
    tag = image_tag(gpu, fabric_name)
    pins = {k: v for k, v in tc["pins"].items() if k != "deepspeed"}
    lock = "\n".join(f"{k}=={v}" for k, v in sorted(pins.items())) + "\n"
    arch = gpu.compute_capability  # "9.0", never "9.0a": DeepSpeed's op builder rejects the suffix
    efa = toolchains()["efa"]
    ctx = {
        "version": __version__,
        "gpu": gpu,
        "toolchain": tc_name,
        "tc": tc,
        "tag": tag,
        "arch": arch,
        "fa_archs": flash_attn_archs(gpu) if tc["flash_attn"] else None,
        "fa4": shell_words([f"{k}=={v}" for k, v in tc["flash_attn_4"].items()])
        if gpu.flash_attn == "fa4" and tc["flash_attn_4"]
        else None,
        "fa": gpu.flash_attn if flash_attn_version(gpu, tc) else "none",
        "rdma": fab.rdma and not gpu.is_cpu,
        "efa": fabric_name == "efa",
        "efa_version": efa["installer"],
        "efa_url": efa["url"].format(version=efa["installer"]),
        "dir": f"images/{image_dir(gpu_name, fabric_name)}",
        "cpu_isa": CPU_ISA,
    }
    install = render_template("image/install.sh.j2", **ctx, torch_index=q(tc["torch_index"] or ""))
    docker_args = {
        "builder_image": tc["builder_image"],
        "runtime_image": tc["runtime_image"],
        "torch_index": tc["torch_index"] or "",
    }
    for key, value in docker_args.items():
        if not _DOCKER_VALUE.match(value):
            raise ValueError(f"images.yaml: {key} {value!r} is not an image reference or URL")
    return {
        DOCKERFILE: render_template(
            "image/Dockerfile.j2",
            **ctx,
            **{k: f'"{v}"' for k, v in docker_args.items()},
            sources=copy_sources(),
        ),
        INSTALL: install,
        LOCK: lock,
        APPTAINER: render_template("image/apptainer.def.j2", **ctx),
        ENROOT: render_template("image/enroot-import.sh.j2", **ctx, q_tag=q(tag)),
    }


def copy_sources() -> list[tuple[str, str]]:
    """(source, destination) of the Dockerfile's COPY lines for the dskit source tree."""
    return [(src, f"{SRC_DIR}/{src}") for src in WHEEL_SOURCES]


def image_dir(gpu_name: str, fabric_name: str = "infiniband") -> str:
    return gpu_name if fabric_name in ("infiniband", "roce", "tcp") else f"{gpu_name}-{fabric_name}"


def catalog_images() -> dict[str, dict[str, str]]:
    """images/ contents: every catalog GPU (RDMA libraries included), plus the EFA variant for H100."""
    out = {image_dir(g): image_files(g) for g in catalog.gpus()}
    out[image_dir("h100-80gb", "efa")] = image_files("h100-80gb", "efa")
    return out
