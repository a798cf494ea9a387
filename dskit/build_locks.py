"""Build locks that an interrupted JIT build left behind, which make every later start hang in silence.

torch.utils.cpp_extension builds an extension (DeepSpeed's `deepspeed_shm_comm` on CPU ranks, `cpu_adam`
for offload where the image did not prebuild it) under a `lock` file it creates with O_EXCL and holds
open for the build; another process that finds the file sleeps until it is gone, with no timeout and no
message (torch/utils/file_baton.py). A build killed mid-compile (Ctrl-C, a preempted job, a test
timeout) never removes it, so every later run on that cache waits forever at `init_distributed`.

A live build holds its lock open, so a lock no process on this host holds open is an orphan, unless a
build on another host that shares the cache holds it (a shared home directory): so dskit names the file
and the command that frees it, and deletes nothing itself. `dskit doctor` and the trainer's start both say it.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path


def extensions_root() -> Path:
    """Where torch builds JIT extensions: TORCH_EXTENSIONS_DIR, else torch's per-user cache."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def _open_files() -> set[str]:
    """Every file a process this user may inspect holds open on this host (Linux /proc)."""
    held: set[str] = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                try:
                    held.add(os.readlink(fd))
                except OSError:  # closed meanwhile
                    continue
        except OSError:  # the process ended, or belongs to another user
            continue
    return held


def orphaned(root: Path | None = None) -> list[Path]:
    """The build locks under `root` (torch's layout: ROOT/<python>_<cuda>/<extension>/lock) that no
    process on this host holds open."""
    root = extensions_root() if root is None else root
    locks = sorted(root.glob("*/*/lock"))
    if not locks:
        return []
    held = _open_files()
    return [lock for lock in locks if str(lock.resolve()) not in held]


def warning(lock: Path) -> str:
    """One line: what the lock does to a run, and how to free it."""
    return (
        f"{lock}: a torch extension build lock no process on this host holds (a build of "
        f"'{lock.parent.name}' was interrupted); a run that loads that extension waits on it forever "
        f"without a message: rm -f {shlex.quote(str(lock))} (unless a host sharing this cache is building it now)"
    )
