"""DeepSpeed's compiled ops in a virtualenv (dskit/jit_ops.py): built once ahead of the run, and not built
again by a rank whose launcher gave it another PATH."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from dskit.jit_ops import use_own_ninja, wanted

LOAD = """
import sys
from dskit.jit_ops import use_own_ninja
if sys.argv[1] == "own":
    use_own_ninja()
from deepspeed.ops.op_builder.all_ops import ALL_OPS
ALL_OPS["deepspeed_shm_comm"].load(verbose=False)
print("loaded")
"""


def _load(path: str, ninja: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", LOAD, ninja],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path},
        timeout=900,
    )
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-3000:]


def _built(op: str) -> tuple[float, str]:
    """The op's library's mtime and ninja's build log in torch's cache."""
    from torch.utils.cpp_extension import _get_build_directory

    d = Path(_get_build_directory(op, verbose=False))
    return (d / f"{op}.so").stat().st_mtime, (d / ".ninja_log").read_text()


def test_the_interpreters_own_ninja_goes_first_whatever_path_the_launcher_gave(monkeypatch):
    scripts = sysconfig.get_path("scripts")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    use_own_ninja()
    assert os.environ["PATH"] == f"{scripts}:/usr/bin:/bin"
    use_own_ninja()  # once is enough
    assert os.environ["PATH"] == f"{scripts}:/usr/bin:/bin"


def test_cpu_ranks_load_their_collectives_and_every_rank_cpu_adam():
    assert wanted(gpu=False) == ["cpu_adam", "deepspeed_shm_comm"]
    assert wanted(gpu=True) == ["cpu_adam", "fused_adam"]


@pytest.mark.slow
def test_an_op_built_ahead_is_not_built_again_by_a_rank_with_the_shells_path():
    """`make setup` builds shm_comm with the venv's ninja; a Slurm job of that venv starts its ranks with
    the user's shell PATH, where another ninja (Debian's, here) or none comes first. Loaded as the trainer
    loads it, the op is found built: same library, nothing added to ninja's log."""
    venv_first = f"{sysconfig.get_path('scripts')}:{os.environ['PATH']}"
    _load(venv_first, "as-given")  # built here if the cache lacks it (minutes), else only checked
    before = _built("deepspeed_shm_comm")
    _load("/usr/local/bin:/usr/bin:/bin", "own")
    assert _built("deepspeed_shm_comm") == before
