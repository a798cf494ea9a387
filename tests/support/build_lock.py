"""torch's JIT extension cache in a test: either of its two layouts in a folder of the test's, and an
interrupted build's lock planted where torch's own build of that extension takes it."""

from __future__ import annotations

from pathlib import Path

#: torch's two layouts: ROOT/<name> under TORCH_EXTENSIONS_DIR, <cache>/torch_extensions/py<ver>_<acc>/<name>
LAYOUTS = ["TORCH_EXTENSIONS_DIR", "default"]


def use_cache(layout: str, where: Path, monkeypatch) -> None:
    """Point this process's (and its children's) torch extension cache into `where`, in `layout`."""
    if layout == "TORCH_EXTENSIONS_DIR":
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(where))
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(where))


def plant(name: str) -> Path:
    """Create the `lock` torch's build of extension `name` would wait on under this process's environment
    (TORCH_EXTENSIONS_DIR or the per-user cache): torch's own layout, so a test cannot plant it where no
    build would look. Returns its path."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    lock.touch()
    return lock
