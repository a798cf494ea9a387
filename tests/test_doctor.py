"""`dskit doctor` on this (CPU) machine: one line per check, JSON, and failures that mean something.

The first test runs the real process (its exit code); the others run doctor's main in this process
(tests/support/cli.py), except where a PYTHONPATH stands for an image's site-packages."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.conftest import dskit
from tests.support.build_lock import LAYOUTS
from tests.support.cli import cli, import_first


@pytest.fixture(autouse=True, scope="module")
def _deepspeed_imported():
    import_first("deepspeed")


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
    r = cli("doctor", "--json", env=env)
    assert r.returncode == 1
    status = {c["name"]: c["status"] for c in json.loads(r.stdout)}
    assert status["gpu"] == "FAIL"  # the contract says GPU, none is visible
    assert status["/dev/shm"] == "FAIL"
    assert status["rdma devices"] == "FAIL"  # fabric wants InfiniBand, no devices
    assert status["flash_attn"] == "FAIL"  # the image promised flash-attn


def test_doctor_build_mode_needs_no_gpu_or_launcher():
    r = cli("doctor", "--build", "--json")
    status = {c["name"]: c["status"] for c in json.loads(r.stdout)}
    assert status["gpu"] == "PASS" and "launch contract" not in status


def test_a_cuda_torch_without_a_c_compiler_fails_before_step_one(tmp_path, monkeypatch, request):
    """Triton compiles its CUDA launcher at the first compiled kernel (the fused loss, the regional
    compile): a GPU image without a C compiler or Python's headers would die at step 1. A stand-in
    `triton` package makes the check reachable on this CPU machine; the compiler lookup is real."""
    from dskit.host.doctor import FAIL, PASS, WARN, _triton_toolchain

    (tmp_path / "site" / "triton").mkdir(parents=True)
    (tmp_path / "site" / "triton" / "__init__.py").write_text('__version__ = "0.0-standin"\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    # the stand-in must not outlive the test: torch.compile in a later test of this process would take it
    # for a real triton and fail importing triton.language
    request.addfinalizer(
        lambda: [sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] == "triton"]
    )
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


def _installed(site, dist: str, version: str, files: dict[str, str]) -> None:
    """A distribution laid out as pip installs it: its files and its dist-info."""
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


#: flash-attn-4 4.0.0b36's `flash_attn/cute/__init__.py` as shipped (its version lookup names a
#: distribution "fa4" that does not exist, so it says 0.0.0); `interface` stands in for the kernels
FA4_INIT = """from importlib.metadata import PackageNotFoundError, version
try:
    __version__ = version("fa4")
except PackageNotFoundError:
    __version__ = "0.0.0"
from .interface import flash_attn_func, flash_attn_varlen_func
"""
#: flash-attn 2.8.3 ships an old `flash_attn/cute` too, which needs FA4's dependencies to import
FA2_CUTE = "raise ModuleNotFoundError(\"No module named 'cuda'\")\n"


def _flash_checks(env: dict) -> dict[str, dict]:
    """doctor's checks by name; in a process of its own where a PYTHONPATH stands for the image's
    site-packages (the kernels it holds import there, and must not be left imported in this one)."""
    run = dskit if "PYTHONPATH" in env else cli
    r = run("doctor", "--build", "--json", env=env)
    return {c["name"]: c for c in json.loads(r.stdout)}


def test_the_hopper_image_is_checked_for_flash_attention_4(tmp_path):
    """Found by its distribution, not its module: flash-attn-4 leaves `flash_attn` a bare namespace,
    which must not read as FlashAttention-2, and its own __version__ says 0.0.0."""
    promised = {"DSKIT_GPU_PROFILE": "h100-80gb", "DSKIT_IMAGE_FLASH_ATTN": "fa4"}
    status = _flash_checks(promised)
    assert status["flash_attn.cute"]["status"] == "FAIL" and status["flash_attn"]["status"] == "PASS"
    fn = "def flash_attn_func(): pass\ndef flash_attn_varlen_func(): pass\n"
    _installed(
        tmp_path,
        "flash-attn-4",
        "4.0.0b36",
        {"flash_attn/cute/__init__.py": FA4_INIT, "flash_attn/cute/interface.py": fn},
    )
    status = _flash_checks({**promised, "PYTHONPATH": str(tmp_path)})
    assert (status["flash_attn.cute"]["status"], status["flash_attn.cute"]["detail"]) == (
        "PASS",
        "flash-attn-4 4.0.0b36",
    )
    assert status["flash_attn"]["detail"] == "not installed (not needed here)"


def test_flash_attention_2s_own_cute_copy_does_not_fail_an_ampere_image(tmp_path):
    """The sm80/86/89 images' build runs `dskit doctor --build`: FA2's bundled `flash_attn/cute`,
    which cannot import there, is not FlashAttention-4 and must not fail the build."""
    _installed(
        tmp_path,
        "flash-attn",
        "2.8.3",
        {"flash_attn/__init__.py": '__version__ = "2.8.3"\n', "flash_attn/cute/__init__.py": FA2_CUTE},
    )
    env = {"DSKIT_GPU_PROFILE": "a100-80gb", "DSKIT_IMAGE_FLASH_ATTN": "fa2", "PYTHONPATH": str(tmp_path)}
    status = _flash_checks(env)
    assert (status["flash_attn"]["status"], status["flash_attn"]["detail"]) == ("PASS", "flash-attn 2.8.3")
    assert status["flash_attn.cute"] == {
        "name": "flash_attn.cute",
        "status": "PASS",
        "detail": "not installed (not needed here)",
    }
    # a broken FA2 (an ABI mismatch at import) is a failed check, not a doctor traceback
    (tmp_path / "flash_attn" / "__init__.py").write_text('raise ImportError("undefined symbol: _ZN3c10")\n')
    status = _flash_checks(env)
    assert status["flash_attn"]["status"] == "FAIL" and "undefined symbol" in status["flash_attn"]["detail"]


def _build_lock_checks() -> list[dict]:
    r = cli("doctor", "--json")
    return [c for c in json.loads(r.stdout) if c["name"] == "build locks"]


@pytest.mark.parametrize("cache", LAYOUTS)
def test_an_interrupted_builds_lock_is_named_with_its_fix_and_a_live_builds_is_not(
    cache, tmp_path, monkeypatch
):
    """torch's JIT build holds its `lock` open while it compiles; a build killed mid-compile leaves the
    file, and every later run that loads the extension waits on it forever without a word. Both places a
    cache is: ROOT/<name> under TORCH_EXTENSIONS_DIR, else this environment's folder of the per-user cache."""
    import shlex
    import subprocess

    from tests.support.build_lock import plant, use_cache

    use_cache(cache, tmp_path / "a cache; rm -rf x", monkeypatch)  # the fix is a shell command: quoted
    lock = plant("deepspeed_shm_comm")
    (warned,) = _build_lock_checks()
    assert warned["status"] == "WARN", warned
    assert f"rm -f {shlex.quote(str(lock))} " in warned["detail"], warned["detail"]
    assert "'deepspeed_shm_comm' was interrupted" in warned["detail"]
    # the same file held open by a live process, as a build in progress holds it
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import time; f = open({str(lock)!r}); print('open', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        assert [c["status"] for c in _build_lock_checks()] == ["PASS"]
    finally:
        holder.kill()
        holder.wait()


#: a path or environment value that would print a line of its own posing as a check, colour the
#: terminal, ring it, and turn the rest of the line around
FORGER = "x\nPASS  gpu                      forged\r\x1b[31m\x07\u202e"


@pytest.mark.parametrize("locked", [False, True], ids=["no lock", "an orphaned lock"])
def test_every_check_is_one_line_whatever_a_path_or_value_holds(locked, tmp_path, monkeypatch):
    """Every value doctor prints (here the torch extension cache's path, with or without a lock in it,
    and the GPU profile it was handed) is escaped as error messages are (dskit.io.text.escape): one line
    per check, the checks --json lists and no other, no raw control character."""
    from dskit.io.text import escape, first_unsafe
    from tests.support.build_lock import plant, use_cache

    use_cache("TORCH_EXTENSIONS_DIR", tmp_path / f"cache{FORGER}", monkeypatch)
    if locked:
        plant("deepspeed_shm_comm")
    env = {"DSKIT_GPU_PROFILE": f"h100-80gb{FORGER}"}
    text = cli("doctor", env=env).stdout
    checks = json.loads(cli("doctor", "--json", env=env).stdout)
    assert text.endswith("\n")
    lines = text[:-1].split("\n")
    assert len(lines) == len(checks)
    assert [
        (ln.split()[0], ln[6:].startswith(escape(c["name"]))) for ln, c in zip(lines, checks, strict=True)
    ] == [(c["status"], True) for c in checks]
    assert [ln for ln in lines if first_unsafe(ln) is not None] == []
    assert any("cachex\\nPASS  gpu" in ln for ln in lines if ln.split()[1:3] == ["build", "locks"])
