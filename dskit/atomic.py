"""Publish a directory all at once: build it beside its destination, then rename it into place.

Used by every command that writes a directory (render, data prepare, export): a failure at any point
leaves the old directory or nothing, never half of the new one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dskit.errors import SpecError


@contextlib.contextmanager
def atomic_dir(out: str | Path, *, force: bool = False, flag: str = "--output") -> Iterator[Path]:
    """Yield a temporary sibling of `out` to fill; on success it replaces `out` (only with `force`)."""
    out = Path(out).resolve()
    if out.exists() and not force:
        raise SpecError(flag, f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
