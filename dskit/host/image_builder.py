"""`dskit build image`: build the rendered Dockerfile of a GPU profile with the container engine that is
here (podman, buildah or docker), then print the tag, the image's size and the build time.

The build context is assembled in a temporary directory from exactly what the Dockerfile copies: the
sources the wheel build reads (`image.WHEEL_SOURCES`, from this checkout) and the freshly rendered
`images/NAME/` files. A repository root as context would send `.venv/` and `runs/` to the engine.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dskit.errors import SpecError, one_of
from dskit.render import image

ENGINES = ("podman", "buildah", "docker")
_BUILD_ARG = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# a container image reference, loosely: no whitespace, no control characters, no leading dash
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")


def source_root() -> Path:
    """The checkout dskit runs from: the image installs dskit from these sources."""
    root = Path(image.__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if not (pyproject.is_file() and 'name = "dskit"' in pyproject.read_text(errors="replace")):
        raise SpecError(
            "build image",
            "needs a source checkout of dskit (the image installs dskit from its sources); "
            "run it from a clone with `pip install -e .`",
        )
    return root


def find_engine(wanted: str) -> str:
    """The engine's executable: the one asked for, or the first of podman, buildah, docker found.
    A docker client without a reachable daemon does not count."""
    names = ENGINES if wanted == "auto" else (wanted,)
    for name in names:
        path = shutil.which(name)
        if path is None:
            continue
        if name == "docker" and not _docker_daemon(path):
            continue
        return path
    if wanted == "auto":
        raise SpecError(
            "--engine",
            "no container engine found (podman, buildah, or docker with a running daemon); "
            "install one, e.g. apt-get install podman",
        )
    raise SpecError(
        "--engine",
        f"{wanted} not found on PATH" + (" or its daemon is not running" if wanted == "docker" else ""),
    )


def _docker_daemon(path: str) -> bool:
    try:
        r = subprocess.run([path, "info"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def make_context(dest: Path, gpu: str, fabric: str) -> str:
    """Write the build context into DEST; returns the Dockerfile's path relative to it."""
    root = source_root()
    files = image.image_files(gpu, fabric)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for rel in image.WHEEL_SOURCES:
        src, dst = root / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=ignore)
        else:
            shutil.copy2(src, dst)
    img_dir = dest / "images" / image.image_dir(gpu, fabric)
    img_dir.mkdir(parents=True)
    for name, text in files.items():
        (img_dir / name).write_text(text)
        if name.endswith(".sh"):
            (img_dir / name).chmod(0o755)
    return str((img_dir / image.DOCKERFILE).relative_to(dest))


def build_command(
    engine: str, dockerfile: str, tag: str, build_args: list[str], extra: list[str]
) -> list[str]:
    name = Path(engine).name
    cmd = [engine, "bud"] if name == "buildah" else [engine, "build"]
    if name in ("podman", "buildah"):
        cmd.append("--format=docker")  # OCI images drop SHELL (the Dockerfile's bash -o pipefail)
    cmd += ["-f", dockerfile, "-t", tag]
    for a in build_args:
        cmd += ["--build-arg", a]
    return cmd + extra + ["."]


def image_size(engine: str, tag: str) -> int | None:
    """Bytes, as the engine reports them (uncompressed); None if it cannot say."""
    name = Path(engine).name
    if name == "buildah":
        cmd = [engine, "images", "--json", tag]
    else:
        cmd = [engine, "image", "inspect", tag]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        data = json.loads(r.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    if not data:
        return None
    entry = data[0]
    size = entry.get("Size", entry.get("size"))
    return int(size) if isinstance(size, (int, float)) else None


def _fmt_seconds(s: float) -> str:
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


def build_image(
    gpu: str,
    fabric: str = "infiniband",
    *,
    tag: str | None = None,
    engine: str = "auto",
    build_args: list[str] | None = None,
    engine_args: list[str] | None = None,
) -> int:
    from dskit import catalog

    if engine not in ("auto", *ENGINES):
        raise SpecError("--engine", f"unknown value {engine!r}; {one_of(('auto', *ENGINES))}")
    build_args = list(build_args or [])
    for a in build_args:
        if not _BUILD_ARG.match(a):
            raise SpecError("--build-arg", f"{a!r} is not NAME=VALUE")
    g = catalog.gpu(gpu, "--gpu")
    catalog.fabric(fabric, "--fabric")
    if g.is_cpu and catalog.fabric(fabric, "--fabric").rdma:
        fabric = "tcp"
    tag = tag or image.image_tag(g, fabric)
    if not _TAG.match(tag):
        raise SpecError("--tag", f"{tag!r} is not an image reference")
    exe = find_engine(engine)
    with tempfile.TemporaryDirectory(prefix="dskit-build-") as ctx:
        dockerfile = make_context(Path(ctx), gpu, fabric)
        cmd = build_command(exe, dockerfile, tag, build_args, list(engine_args or []))
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        start = time.monotonic()
        r = subprocess.run(cmd, cwd=ctx)
        took = time.monotonic() - start
    if r.returncode != 0:
        print(
            f"dskit: error: build image: {Path(exe).name} build exited {r.returncode} after {_fmt_seconds(took)}",
            file=sys.stderr,
        )
        return 1
    size = image_size(exe, tag)
    size_s = f"{size / 2**30:.2f} GiB" if size is not None else "size unknown"
    print(f"built {tag} with {Path(exe).name} in {_fmt_seconds(took)} ({took:.0f} s): {size_s}")
    return 0
