"""An interrupted JIT build's lock, planted where torch's own build of that extension takes it."""

from __future__ import annotations

from pathlib import Path


def plant(name: str) -> Path:
    """Create the `lock` torch's build of extension `name` would wait on under this process's environment
    (TORCH_EXTENSIONS_DIR or the per-user cache): torch's own layout, so a test cannot plant it where no
    build would look. Returns its path."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    lock.touch()
    return lock
