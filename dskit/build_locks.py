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

import os
import sys
from pathlib import Path

from dskit import env_vars
from dskit.text import command, escape


def extensions_root() -> Path:
    """Where torch builds JIT extensions: TORCH_EXTENSIONS_DIR (set, even empty, as torch reads it), else
    torch's per-user cache."""
    if (root := env_vars.read("TORCH_EXTENSIONS_DIR")) is not None:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def build_directory(name: str) -> Path:
    """Where torch builds extension `name` (cpp_extension._get_build_directory's layout, which creates
    the folder; this only names it): ROOT/<name> under TORCH_EXTENSIONS_DIR, else
    ROOT/py<ver>_<accelerator>/<name>."""
    root = extensions_root()
    if env_vars.read("TORCH_EXTENSIONS_DIR") is not None:
        return root / name
    import torch

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return root / f"{python}_{accelerator}" / name


def _locks(root: Path) -> list[Path]:
    """The build locks under `root` in torch's layout (cpp_extension._get_build_directory): ROOT/<name>/lock
    under TORCH_EXTENSIONS_DIR, ROOT/py<ver>_<accelerator>/<name>/lock under the default cache."""
    depth = "*/lock" if env_vars.read("TORCH_EXTENSIONS_DIR") is not None else "*/*/lock"
    return sorted(root.glob(depth))


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
