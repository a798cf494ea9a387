"""`dskit doctor`: is this container/host able to run the plan? One PASS/WARN/FAIL line per check.

Runs anywhere (no GPU needed); imports torch/deepspeed lazily and reports their absence instead of
crashing. `--build` is the image's smoke test: nothing there may need a GPU or a launcher.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dskit.errors import SpecError
from dskit.host.flash_kernels import KERNELS, probe
from dskit.io.text import escape
from dskit.launch import env_vars
from dskit.launch.contract import REQUIRED, Env

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
GIB = 2**30


@dataclass
class Check:
    name: str
    status: str
    detail: str


def _version(mod: str) -> str | None:
    """`mod`'s __version__, None if it is absent, or the import error of a broken install."""
    if importlib.util.find_spec(mod) is None:
        return None
    try:
        if mod == "deepspeed":  # as the trainer imports it: without MLflow's second (dskit/host/jit_ops.py)
            from dskit.host.jit_ops import import_deepspeed

            import_deepspeed(mlflow=False)
        return getattr(importlib.import_module(mod), "__version__", "unknown")
    except Exception as e:  # a broken install (ABI mismatch: "undefined symbol") is exactly what we report
        return f"IMPORT ERROR: {str(e).splitlines()[0][:200]}"


def _dist_version(dist: str) -> str | None:
    """An installed distribution's version from its metadata, without importing it; None if absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


@contextlib.contextmanager
def _stdout_to_stderr():
    """DeepSpeed logs to stdout from import time on; keep the report (and --json) clean."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_checks(build: bool = False) -> list[Check]:
    with _stdout_to_stderr():
        return _run_checks(build)


@dataclass(frozen=True)
class _Host:
    """What the checks after python and torch depend on, read once."""

    build: bool  # `--build`: the image's smoke test, no GPU or launcher expected
    gpu: bool  # a CUDA device is visible
    cuda_build: str | None  # the CUDA version torch was built for (None: a CPU torch)

    @property
    def image_arch(self) -> str:
        """The compute capability the image was built for ("" outside a dskit image); read by the checks
        that use it, so that a value that does not parse fails those (below) and no other."""
        return env_vars.read("DSKIT_IMAGE_ARCH") or ""


def _run_checks(build: bool) -> list[Check]:
    out = [_python(), _torch()]
    if out[-1].status == FAIL:
        return out  # every check below imports torch
    import torch

    host = _Host(build, torch.cuda.is_available(), torch.version.cuda)
    for check in CHECKS:
        try:
            out.extend(check(host))
        except SpecError as e:  # an environment value that does not parse: doctor reports it and goes on
            out.append(Check(e.field, FAIL, e.message))
    return out


def _python() -> Check:
    py = platform.python_version()
    return Check("python", PASS if sys.version_info >= (3, 10) else FAIL, f"{py} at {sys.executable}")


def _torch() -> Check:
    tv = _version("torch")
    if tv is None or tv.startswith("IMPORT ERROR"):
        return Check("torch", FAIL, tv or "not installed (pip install 'dskit[train]')")
    import torch

    cudnn = torch.backends.cudnn.version() or "none"
    return Check("torch", PASS, f"{tv} (CUDA {torch.version.cuda or 'none'}, cuDNN {cudnn})")


def _gpu(host: _Host) -> list[Check]:
    import torch

    if host.gpu:
        cc = torch.cuda.get_device_capability(0)
        name = torch.cuda.get_device_name(0)
        detail = f"{torch.cuda.device_count()} x {name}, compute capability {cc[0]}.{cc[1]}"
        return [Check("gpu", PASS, detail)]
    if host.build:
        arch = f" (image arch {host.image_arch})" if host.image_arch else ""
        return [Check("gpu", PASS, "not checked at image build time" + arch)]
    profile = env_vars.read(Env.GPU_PROFILE.value) or "cpu"
    want_gpu = profile != "cpu"
    return [
        Check(
            "gpu",
            FAIL if want_gpu else WARN,
            "no CUDA device visible" + (f" but {Env.GPU_PROFILE.value}={profile}" if want_gpu else ""),
        )
    ]


def _torch_arch(host: _Host) -> list[Check]:
    if not host.gpu:
        return []
    import torch

    cc = torch.cuda.get_device_capability(0)
    archs = torch.cuda.get_arch_list()
    arch_ok = any(a.startswith(f"sm_{cc[0]}{cc[1]}") for a in archs) or any(
        a.startswith(f"sm_{cc[0]}") for a in archs
    )
    return [
        Check(
            "torch arch list",
            PASS if arch_ok else FAIL,
            f"torch kernels for {', '.join(archs)}"
            + ("" if arch_ok else f": none runs on sm_{cc[0]}{cc[1]}"),
        )
    ]


def _image_arch(host: _Host) -> list[Check]:
    if not (host.gpu and host.image_arch):
        return []
    import torch

    cc = torch.cuda.get_device_capability(0)
    have = f"{cc[0]}.{cc[1]}"
    return [
        Check(
            "image arch",
            PASS if host.image_arch == have else FAIL,
            f"image built for {host.image_arch}, this GPU is {have}"
            + (
                ""
                if host.image_arch == have
                else ": DeepSpeed/flash-attn ops will not load; use `dskit render image --gpu` for it"
            ),
        )
    ]


def _bf16(host: _Host) -> list[Check]:
    if not host.gpu:
        return []
    import torch

    if torch.cuda.is_bf16_supported():
        return [Check("bf16", PASS, "supported")]
    return [Check("bf16", WARN, "not supported: the plan will use fp16 with loss scaling")]


def _nccl(host: _Host) -> list[Check]:
    if not host.gpu:
        return []
    import torch

    try:
        return [Check("nccl", PASS, "version " + ".".join(map(str, torch.cuda.nccl.version())))]
    except Exception as e:
        return [Check("nccl", FAIL, f"unavailable: {e}")]


def _flash_attn(host: _Host) -> list[Check]:
    """The FlashAttention the image says it carries (DSKIT_IMAGE_FLASH_ATTN: fa2, fa4 or none) is
    installed and imports; the other is reported, and fails only if it is installed but broken."""
    fa_expected = env_vars.read("DSKIT_IMAGE_FLASH_ATTN")
    checks = []
    for gen, backend in (("fa2", "flash_attention_2"), ("fa4", "flash_attention_4")):
        dist, mod = KERNELS[backend]
        version, error = probe(backend)
        expected = fa_expected == gen
        if version is None:
            checks.append(
                Check(
                    mod,
                    FAIL if expected else PASS,
                    "not installed" + (" but the image should have it" if expected else " (not needed here)"),
                )
            )
        else:
            checks.append(
                Check(mod, FAIL, f"IMPORT ERROR: {error}") if error else Check(mod, PASS, f"{dist} {version}")
            )
    return checks


def _fp8(host: _Host) -> list[Check]:
    """torchao, which training.fp8 needs (the fp8 extra; the cu130 images carry it): its version, read
    without importing it; on a GPU that can train in FP8, imported and one FP8 GEMM run through the path
    the trainer takes (dskit/train/fp8/compute.py), eager: a broken install shows here, not in rank 0."""
    version = _dist_version("torchao")
    if version is None:
        return [Check("torchao", PASS, "not installed (training.fp8 needs it: pip install 'dskit[fp8]')")]
    if not host.gpu:
        return [Check("torchao", PASS, f"{version} (FP8 GEMM not run: no GPU here)")]
    import torch

    from dskit.refusals import FP8_MIN_CAPABILITY

    if torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        return [Check("torchao", PASS, f"{version} (this GPU cannot train in FP8)")]
    try:
        from dskit.train.fp8.compute import fp8_product

        x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
        y = fp8_product("tensorwise", compiled=False)(x, w)
        err = ((y.float() - x.float() @ w.float().t()).norm() / (x.float() @ w.float().t()).norm()).item()
    except Exception as e:  # any failure of the FP8 path is this line's FAIL, not doctor's crash
        return [Check("torchao", FAIL, f"{version}: one FP8 GEMM failed: {type(e).__name__}: {e}")]
    if not err < 0.1:
        return [Check("torchao", FAIL, f"{version}: one FP8 GEMM is {err:.0%} off the bf16 product")]
    return [Check("torchao", PASS, f"{version}: one FP8 GEMM ran ({err:.1%} off the bf16 product)")]


def _deepspeed(host: _Host) -> list[Check]:
    dv = _version("deepspeed")
    if dv is None or dv.startswith("IMPORT ERROR"):
        return [Check("deepspeed", FAIL, dv or "not installed")]
    try:
        ops = _deepspeed_ops(host.gpu)
    except SpecError as e:  # DSKIT_IMAGE_ARCH decides which ops: the version still stands
        ops = [Check("deepspeed ops", FAIL, f"{e.field}: {e.message}")]
    return [Check("deepspeed", PASS, dv), *ops]


def _build_locks(host: _Host) -> list[Check]:
    from dskit.host.build_locks import extensions_root, orphaned, warning

    found = orphaned()
    if not found:
        return [Check("build locks", PASS, f"no orphaned torch extension lock under {extensions_root()}")]
    return [Check("build locks", WARN, warning(lock)) for lock in found]


def _triton(host: _Host) -> list[Check]:
    if not host.cuda_build:
        return []
    # a CUDA torch on a machine that will not train on a GPU (a login node, a CI runner) compiles nothing
    return [_triton_toolchain(required=host.gpu or host.build)]


def _launch_contract(host: _Host) -> list[Check]:
    if host.build:
        return []
    missing = env_vars.unset(REQUIRED)
    return [
        Check(
            "launch contract",
            PASS if not missing else WARN,
            "all set" if not missing else f"not set: {', '.join(missing)} (fine outside a dskit job)",
        )
    ]


def _deepspeed_ops(gpu: bool) -> list[Check]:
    """Which ops are prebuilt (installed_ops), built in torch's JIT cache, or compiled by every worker."""
    try:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        from dskit.host.jit_ops import cached, prebuilt, wanted
    except Exception as e:
        return [Check("deepspeed ops", FAIL, f"cannot read the op report: {e}")]
    checks = []
    for op in wanted(gpu):
        name = f"deepspeed op {op}"
        if prebuilt(op):
            checks.append(Check(name, PASS, "prebuilt"))
        elif op not in ALL_OPS or not ALL_OPS[op].is_compatible():
            checks.append(Check(name, FAIL, "incompatible with this environment"))
        elif (lib := cached(op)) is not None:
            checks.append(
                Check(
                    name,
                    PASS,
                    f"built in torch's extension cache ({lib.parent}): a worker rebuilds it only where its sources or flags changed",
                )
            )
        else:
            checks.append(
                Check(
                    name,
                    WARN,
                    "not built: every worker JIT-compiles it at start, minutes on a small host "
                    "(`python -m dskit.host.jit_ops` builds it ahead of the run)",
                )
            )
    return checks


def _triton_toolchain(required: bool) -> Check:
    """Triton builds a small C extension (its CUDA launcher) the first time a compiled kernel runs: the
    fused chunked loss and the regional compile on GPUs. Without a C compiler, the C library's headers and
    Python's, the job dies at its first step ("Failed to find C compiler"), so the image must carry them.
    Checked the way Triton builds: compile a file that includes Python.h. `required`: FAIL, else WARN."""
    import shutil
    import subprocess
    import sysconfig

    name, bad = "triton toolchain", FAIL if required else WARN
    if importlib.util.find_spec("triton") is None:
        return Check(
            name, bad, "triton not installed: torch.compile on GPUs (fused loss, regional compile) needs it"
        )
    cc = env_vars.read("CC") or shutil.which("gcc") or shutil.which("clang")
    # Triton's own lookup (triton/runtime/build.py): Debian's posix_local scheme is read as posix_prefix
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    fix = (
        f"install gcc, libc6-dev and python{sys.version_info.major}.{sys.version_info.minor}-dev, or train "
        "with overrides.compile=off and overrides.loss=full"
    )
    if not cc:
        return Check(
            name,
            bad,
            f"no C compiler (CC, gcc or clang): Triton builds its launcher at the first "
            f"compiled kernel; {fix}",
        )
    try:
        r = subprocess.run(
            [cc, "-fsyntax-only", "-x", "c", f"-I{include}", "-"],
            input="#include <Python.h>\n#include <stdlib.h>\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        err = r.stderr.strip().splitlines()[-1] if r.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        err = str(e)
    if err:
        return Check(name, bad, f"{cc} cannot compile against {include}/Python.h ({err}); {fix}")
    return Check(name, PASS, f"triton {_version('triton')}, {cc} compiles against {include}/Python.h")


def _shm() -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return Check("/dev/shm", FAIL, "missing")
    size = st.f_frsize * st.f_blocks
    provisioned = env_vars.read(Env.SHM_BYTES.value)
    want = 1 * GIB if provisioned is None else provisioned
    detail = f"{size / GIB:.1f} GiB, want >= {want / GIB:.1f} GiB"
    if size < want:
        return Check(
            "/dev/shm", FAIL, detail + " (Docker's 64 MB default breaks NCCL: --shm-size or an emptyDir)"
        )
    return Check("/dev/shm", PASS, detail)


def _infiniband() -> Check:
    ib = Path("/sys/class/infiniband")
    devs = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    wants_rdma = env_vars.read("NCCL_IB_DISABLE") == "0" or env_vars.read("FI_PROVIDER") == "efa"
    if devs:
        return Check("rdma devices", PASS, ", ".join(devs))
    return Check(
        "rdma devices",
        FAIL if wants_rdma else PASS,
        "none"
        + (" but the fabric in the launch contract needs RDMA" if wants_rdma else " (not needed here)"),
    )


#: Every check after python and torch, in the order they print; each returns its lines ([] where it
#: does not apply here).
CHECKS: tuple[Callable[[_Host], list[Check]], ...] = (
    _gpu,
    _torch_arch,
    _image_arch,
    _bf16,
    _nccl,
    _flash_attn,
    _fp8,
    _deepspeed,
    _build_locks,
    _triton,
    lambda host: [_shm()],  # /dev/shm and the RDMA devices need nothing from _Host
    lambda host: [_infiniband()],
    _launch_contract,
)


def main(as_json: bool = False, build: bool = False) -> int:
    checks = run_checks(build=build)
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        for c in checks:
            # one line a check, whatever a path, an environment value or an error text holds: escaped
            # (dskit.io.text.escape), no line of it can pose as another check or reach the terminal raw
            print(f"{c.status:4s}  {escape(c.name):24s} {escape(c.detail)}")
    return 1 if any(c.status == FAIL for c in checks) else 0
