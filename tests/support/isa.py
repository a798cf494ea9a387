"""Which instruction sets DeepSpeed's compiled ops use: the images promise x86-64-v3 code whatever the
build host has (tests/e2e/test_image_build.py, tests/e2e/test_image_install.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

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
