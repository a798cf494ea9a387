"""DeepSpeed's compiled ops a rank on this host loads, and building the missing ones ahead of the run.

An op the DeepSpeed install did not prebuild (`installed_ops`) is JIT-compiled by every fresh process
that loads it, under torch's build lock (dskit/host/build_locks.py): minutes of g++ on a small host, inside
whatever deadline the launcher or a health check gives the start, and a process killed midway leaves
the lock that every later start waits on forever. The images prebuild these ops (images/*/install.sh,
DS_BUILD_*); a virtualenv (`make ops`, Slurm's `runtime: none`) builds them here once instead:

    python -m dskit.host.jit_ops        # into torch's extension cache; later loads only check it

with the ninja and the cache every rank of a run uses (`use_own_builds`, which the trainer calls before DeepSpeed
starts): a build by another ninja would not count as built. A cache serves the hosts that share it
only where their CPUs match the builder's: DeepSpeed compiles cpu_adam with -march=native and the
building CPU's SIMD width, so a host of another width rebuilds it, and one of the same width with fewer
instructions may die on it (illegal instruction). Build it where the ranks run, or use an image.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import sysconfig
import time
from pathlib import Path

from dskit.launch import env_vars


def import_deepspeed(*, mlflow: bool) -> None:
    """DeepSpeed's autotuner imports MLflow wherever it is installed (deepspeed/autotuning/autotuner.py,
    at `import deepspeed`), and MLflow brings pandas, pyarrow, scipy and its server's web stack: about a
    second of every rank's start (measured with `python -X importtime` on 2 cores), for an autotuner
    training never runs. Unless the run logs to MLflow itself (`mlflow`), DeepSpeed is imported with
    MLflow hidden from it; MLflow stays importable afterwards."""
    if mlflow or "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed  # noqa: F401

        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]


def use_own_builds() -> None:
    """Compiled ops build and load through this interpreter's environment, whatever the launcher gave:
    - its own extension cache (dskit/host/build_locks.py `environment_cache`), unless TORCH_EXTENSIONS_DIR
      names one: environments sharing torch's default folder rebuilt each other's ops;
    - its `ninja` (a DeepSpeed dependency) first on PATH, as the images do. torch builds with the first
      `ninja` on PATH, which a launcher's PATH decides: a Slurm job of a virtualenv gets the user's shell
      PATH, Ray's workers their own. Two ninjas on one cache keep their build logs in different formats,
      so each switch rebuilds every op (seen here between Debian's 1.11 and pip's 1.13: cpu_adam 160 s
      and shm_comm 92 s again on a busy 2-core host); without a system ninja the load fails ("Ninja is
      required to load C++ extensions").
    Both go into os.environ, so the processes this one starts inherit them. And py-cpuinfo answers once
    (`cpu_info_once`)."""
    from dskit.host.build_locks import extensions_root

    cpu_info_once()

    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_root())
    scripts = sysconfig.get_path("scripts")
    if not os.path.isfile(os.path.join(scripts, "ninja")):
        return
    path = env_vars.read("PATH") or ""
    if path.split(os.pathsep)[0] != scripts:
        os.environ["PATH"] = scripts + (os.pathsep + path if path else "")


def cpu_info_once() -> None:
    """py-cpuinfo's `get_cpu_info` starts a fresh interpreter at every call (`cpuinfo.py --json`, which
    runs CPUID in a process of its own, so that a crash there cannot take the caller along), and
    DeepSpeed asks it at every op load (`cpu_arch` and `simd_width`, for the compile flags torch compares
    with the cached build's) and in DeepSpeedCPUAdam's constructor: two interpreters a CPU rank, three
    where it steps CPU Adam, about 0.6 CPU-seconds and a second of its start each on 2 cores (measured
    2026-12-06). The answer describes this machine's CPU for the life of the process, so the first is
    kept and each caller gets its own copy; py-cpuinfo still computes it, isolated as it chooses."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed falls back to lscpu without it
        return
    if getattr(cpuinfo.get_cpu_info, "dskit_once", False):
        return
    first = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict:
        return copy.deepcopy(first())

    get_cpu_info.dskit_once = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def wanted(gpu: bool) -> list[str]:
    """The compiled ops a rank loads: cpu_adam (optimizer offload, and `dskit calibrate`'s CPU Adam), plus
    fused_adam (the engine's Adam) on GPUs, or DeepSpeed's shared-memory collectives on CPU ranks (the
    CPU accelerator runs torch's AdamW: the plan's optimizer.params.torch_adam). A GPU image's build
    (DSKIT_IMAGE_ARCH set) counts as a GPU host: it has no device yet."""
    gpu = gpu or bool(env_vars.read("DSKIT_IMAGE_ARCH"))
    return ["cpu_adam"] + (["fused_adam"] if gpu else ["deepspeed_shm_comm"])


def prebuilt(op: str) -> bool:
    """Whether DeepSpeed loads `op` from its install (DS_BUILD_*), as OpBuilder.load decides: built in,
    for the accelerator running now."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    return bool(installed_ops.get(op)) and accelerator_name == get_accelerator()._name


def cached(op: str) -> Path | None:
    """The library a JIT build of `op` left in torch's extension cache, if any."""
    from dskit.host.build_locks import build_directory

    lib = build_directory(op) / f"{op}.so"
    return lib if lib.is_file() else None


def main(argv: list[str] | None = None) -> int:
    from dskit.cli.args import Parser

    Parser(
        prog="python -m dskit.host.jit_ops",
        description="Build the DeepSpeed ops a rank on this host loads that the install did not prebuild "
        "into this environment's torch extension cache (TORCH_EXTENSIONS_DIR, else its own folder of "
        "~/.cache/torch_extensions), with this "
        "environment's ninja. Exit 1 on an orphaned build lock or a failed build, 2 on an environment value that does not parse or a missing train extra (one line).",
    ).parse_args(argv)
    from dskit.host.extras import refused

    if (code := refused("python -m dskit.host.jit_ops", "train")) is not None:
        return code
    from dskit.errors import EXIT_BAD_INPUT, SpecError

    try:
        return _build()
    except SpecError as e:  # an environment value that does not parse (dskit/launch/env_vars.py)
        _say(f"dskit: error: {e}", sys.stderr)
        return EXIT_BAD_INPUT


def _say(line: str, stream=None) -> None:
    """Every line main prints: one line, escaped (a path, an environment value or a compiler's error
    holding a newline or ESC cannot add a line that poses as another, nor reach the terminal raw)."""
    from dskit.io.text import escape

    print(escape(line), file=stream or sys.stdout)


def _build() -> int:
    env_vars.read("DSKIT_IMAGE_ARCH")  # a value that does not parse is refused before torch loads (seconds)
    import torch
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    from dskit.host.build_locks import extensions_root, orphaned, warning

    ops = wanted(torch.cuda.is_available())  # first: a bad DSKIT_IMAGE_ARCH is refused before any work
    stuck = orphaned()
    for lock in stuck:  # a load would wait on it forever, without a word
        _say(f"dskit.host.jit_ops: {warning(lock)}", sys.stderr)
    if stuck:
        return 1
    use_own_builds()
    failed = 0
    for op in ops:
        builder = ALL_OPS.get(op)
        if prebuilt(op):
            _say(f"deepspeed op {op}: prebuilt in the DeepSpeed install")
        elif builder is None or not builder.is_compatible(verbose=False):
            _say(
                f"deepspeed op {op}: skipped, incompatible with this host (`dskit doctor` says what it costs)"
            )
        else:
            t0 = time.monotonic()
            try:
                builder.load(verbose=False)
            except Exception as e:  # the compiler's own output is above; one line per op here
                _say(f"dskit.host.jit_ops: deepspeed op {op}: build failed: {e}", sys.stderr)
                failed += 1
                continue
            _say(f"deepspeed op {op}: ready in {time.monotonic() - t0:.0f} s under {extensions_root()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
