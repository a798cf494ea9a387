"""`dskit doctor` on this (CPU) machine: one line per check, JSON, and failures that mean something."""

from __future__ import annotations

import json
import shutil

from tests.conftest import dskit


def test_doctor_reports_every_check_as_one_line():
    r = dskit("doctor", env={"DSKIT_GPU_PROFILE": "cpu"})
    lines = r.stdout.strip().splitlines()
    names = [ln.split()[1] for ln in lines]
    for want in ("python", "torch", "gpu", "flash_attn", "deepspeed", "/dev/shm", "rdma", "launch"):
        assert want in names, r.stdout
    assert all(ln.split()[0] in ("PASS", "WARN", "FAIL") for ln in lines)
    assert r.returncode == (1 if any(ln.startswith("FAIL") for ln in lines) else 0)


def test_doctor_fails_where_a_job_would():
    env = {
        "DSKIT_GPU_PROFILE": "h100-80gb",
        "DSKIT_SHM_BYTES": str(10**15),
        "NCCL_IB_DISABLE": "0",
        "DSKIT_IMAGE_FLASH_ATTN": "fa2",
    }
    r = dskit("doctor", "--json", env=env)
    assert r.returncode == 1
    status = {c["name"]: c["status"] for c in json.loads(r.stdout)}
    assert status["gpu"] == "FAIL"  # the contract says GPU, none is visible
    assert status["/dev/shm"] == "FAIL"
    assert status["rdma devices"] == "FAIL"  # fabric wants InfiniBand, no devices
    assert status["flash_attn"] == "FAIL"  # the image promised flash-attn


def test_doctor_build_mode_needs_no_gpu_or_launcher():
    r = dskit("doctor", "--build", "--json")
    status = {c["name"]: c["status"] for c in json.loads(r.stdout)}
    assert status["gpu"] == "PASS" and "launch contract" not in status


def test_a_cuda_torch_without_a_c_compiler_fails_before_step_one(tmp_path, monkeypatch):
    """Triton compiles its CUDA launcher at the first compiled kernel (the fused loss, the regional
    compile): a GPU image without a C compiler or Python's headers would die at step 1. A stand-in
    `triton` package makes the check reachable on this CPU machine; the compiler lookup is real."""
    from dskit.doctor import FAIL, PASS, WARN, _triton_toolchain

    (tmp_path / "site" / "triton").mkdir(parents=True)
    (tmp_path / "site" / "triton" / "__init__.py").write_text('__version__ = "0.0-standin"\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    real_cc = shutil.which("cc") or shutil.which("gcc")  # CI has one: inductor's CPU tests need it too
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    missing = _triton_toolchain(required=True)
    assert missing.status == FAIL and "C compiler" in missing.detail and "-dev" in missing.detail
    # a CUDA torch where no GPU will train (a login node, a CI runner): a warning, not a failure
    assert _triton_toolchain(required=False).status == WARN
    # a compiler that cannot build against Python.h (headers not installed) is named with its error
    broken = tmp_path / "cc-without-headers"
    broken.write_text("#!/bin/sh\necho 'fatal error: Python.h: No such file or directory' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    no_headers = _triton_toolchain(required=True)
    assert no_headers.status == FAIL and "Python.h: No such file" in no_headers.detail
    monkeypatch.setenv("CC", real_cc)  # this machine's real compiler and Python's real headers
    assert _triton_toolchain(required=True).status == PASS


def test_the_hopper_image_is_checked_for_flash_attention_4(tmp_path):
    """flash-attn-4 installs `flash_attn/cute` and no `flash_attn/__init__.py`: `flash_attn` is then a
    bare namespace, which must not read as FlashAttention-2, and the check names the FA4 release
    (from its distribution: `flash_attn.cute` has no __version__). The layout is the wheel's own,
    module bodies empty; without it the promised FA4 fails the check."""
    promised = {"DSKIT_GPU_PROFILE": "h100-80gb", "DSKIT_IMAGE_FLASH_ATTN": "fa4"}
    status = {c["name"]: c for c in json.loads(dskit("doctor", "--build", "--json", env=promised).stdout)}
    assert status["flash_attn.cute"]["status"] == "FAIL" and status["flash_attn"]["status"] == "PASS"
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    dist = tmp_path / "flash_attn_4-4.0.0b36.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn-4\nVersion: 4.0.0b36\n")
    r = dskit("doctor", "--build", "--json", env={**promised, "PYTHONPATH": str(tmp_path)})
    status = {c["name"]: c for c in json.loads(r.stdout)}
    assert (status["flash_attn.cute"]["status"], status["flash_attn.cute"]["detail"]) == ("PASS", "4.0.0b36")
    assert status["flash_attn"]["detail"] == "not installed (not needed here)"
