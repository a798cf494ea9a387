"""torch's JIT extension cache in a test: either of its two layouts in a folder of the test's, and an
interrupted build's lock planted where torch's own build of that extension takes it."""

from __future__ import annotations

import os
from pathlib import Path

#: the two places a cache is: TORCH_EXTENSIONS_DIR as set, or this environment's folder of the per-user cache
#: (<cache>/torch_extensions/py<ver>_<acc>-env-<key>)
LAYOUTS = ["TORCH_EXTENSIONS_DIR", "default"]


def use_cache(layout: str, where: Path, monkeypatch) -> None:
    """Point this process's (and its children's) torch extension cache into `where`, in `layout`."""
    if layout == "TORCH_EXTENSIONS_DIR":
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(where))
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(where))


def plant(name: str) -> Path:
    """Create the `lock` torch's build of extension `name` would wait on in a dskit process under this
    process's environment (TORCH_EXTENSIONS_DIR, or this environment's folder of the per-user cache,
    which dskit.host.jit_ops.use_own_builds hands torch): torch's own layout, so a test cannot plant it where
    no build would look. Returns its path."""
    from torch.utils.cpp_extension import _get_build_directory

    from dskit.host.build_locks import extensions_root

    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_root())
    try:
        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    finally:
        if saved is None:
            del os.environ["TORCH_EXTENSIONS_DIR"]
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved
    lock.touch()
    return lock
