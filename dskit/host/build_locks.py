"""Build locks that an interrupted JIT build left behind, which make every later start hang in silence.

torch.utils.cpp_extension builds an extension (DeepSpeed's `deepspeed_shm_comm` on CPU ranks, `cpu_adam`
for offload where the image did not prebuild it) under a `lock` file it creates with O_EXCL and holds
open for the build; another process that finds the file sleeps until it is gone, with no timeout and no
message (torch/utils/file_baton.py). A build killed mid-compile (Ctrl-C, a preempted job, a test
timeout) never removes it, so every later run on that cache waits forever at `init_distributed`.

A live build holds its lock open, so a lock no process on this host holds open is an orphan, unless a
build on another host or in another container that shares the cache holds it (a shared home directory, a
host mount): so dskit names the file and the command that frees it, and deletes nothing itself.
`dskit doctor` and the trainer's start both say it.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from dskit.io.text import command, escape
from dskit.launch import env_vars


def extensions_root() -> Path:
    """Where torch builds JIT extensions for dskit's processes: TORCH_EXTENSIONS_DIR where the user set
    it (even empty, as torch reads it), else this environment's own folder of torch's per-user cache
    (`environment_cache`), which `dskit.host.jit_ops.use_own_builds` hands torch before DeepSpeed loads
    an op."""
    if (root := env_vars.read("TORCH_EXTENSIONS_DIR")) is not None:
        return Path(root)
    return environment_cache()


def environment_cache() -> Path:
    """This Python environment's folder of torch's per-user cache (where torch's default folder lies:
    $XDG_CACHE_HOME, else ~/.cache, then torch_extensions/): named for the Python version, keyed by the
    environment's prefix and its torch (a torch of another version or CUDA build needs its own builds).
    Torch's default is one folder per Python version and accelerator, which every virtualenv of that
    version shares: two checkouts' environments rebuilt each other's cpu_adam at every switch, 142 s
    each on 2 cores, and a start waited on the other's build. Torch is not imported (every test process
    and `dskit doctor` name this folder)."""
    from importlib import metadata

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    key = hashlib.sha256(f"{os.path.realpath(sys.prefix)}\0{torch_version}".encode()).hexdigest()[:12]
    cache = env_vars.read("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.path.realpath(cache)) / "torch_extensions" / f"{python}-env-{key}"


def build_directory(name: str) -> Path:
    """Where torch builds extension `name` once `use_own_builds` ran (cpp_extension._get_build_directory's
    layout under TORCH_EXTENSIONS_DIR, which creates the folder; this only names it): ROOT/<name>."""
    return extensions_root() / name


def _locks(root: Path) -> list[Path]:
    """The build locks under `root` in torch's layout under TORCH_EXTENSIONS_DIR: ROOT/<name>/lock."""
    return sorted(root.glob("*/lock"))


def _open_files() -> tuple[set[str], bool]:
    """Every file the processes this user may inspect hold open on this host (Linux /proc), and whether
    that was every process (False: some belong to another user, whose builds this cannot see)."""
    held: set[str] = set()
    every = True
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            fds = list(fd_dir.iterdir())
        except PermissionError:
            every = False
            continue
        except OSError:  # the process ended
            continue
        for fd in fds:
            try:
                held.add(os.readlink(fd))
            except OSError:  # closed meanwhile
                continue
    return held, every


def orphaned(root: Path | None = None) -> list[Path]:
    """The build locks under `root` (default: extensions_root()) that no process on this host holds open.
    Without /proc nothing can be told, so nothing is claimed; a lock of another user's is claimed only
    when every process's files could be read."""
    root = extensions_root() if root is None else root
    locks = _locks(root)
    if not locks or not Path("/proc/self/fd").is_dir():
        return []
    held, every = _open_files()
    uid = os.getuid()
    found = []
    for lock in locks:
        try:
            mine = lock.stat().st_uid == uid
        except FileNotFoundError:  # its build finished meanwhile
            continue
        # listed before /proc was read: a build that ended in between has removed its lock by now
        if str(lock.resolve()) not in held and (every or mine) and lock.exists():
            found.append(lock)
    return found


def warning(lock: Path) -> str:
    """One line, whatever the path holds: what the lock does to a run, and the command that frees it."""
    return (
        f"{escape(str(lock))}: a torch extension build lock no process on this host holds (a build of "
        f"'{escape(lock.parent.name)}' was interrupted); a run that loads that extension waits on it forever "
        f"without a message: {command(['rm', '-f', lock])} (unless a host or container sharing this "
        "cache is building it now)"
    )
