"""Publish a directory all at once: build it beside its destination, then swap it into place.

Used by every command that writes a directory (render, data prepare, export): a failure at any point
leaves the old directory or nothing, never half of the new one.

`--force` replaces only what the same kind of dskit command wrote: every directory published here
carries MARKER with its kind (a run dir, prepared data, an export). Refused (one line, exit 2) before
anything is written: an existing destination without MARKER or of another kind, a file, the current
directory or one of its parents, a directory holding a repository (.git, .hg, .svn), and a directory
that contains one of the command's inputs.

The swap: on Linux, renameat2(RENAME_EXCHANGE) swaps the new and the old directory in one step, so the
destination always names one of them. Elsewhere (or on a filesystem without it) the old directory is
renamed aside to `.NAME.dskit-old-*` and the new one renamed in; a crash between those two renames
leaves no NAME but the complete old directory at `.NAME.dskit-old-*`: rename it back, or run again.

A build killed mid-way (kill -9) leaves a hidden `.NAME.dskit-tmp-*` sibling; the next run for the
same destination removes those whose builder is provably gone: it holds a lock on their MARKER while
it runs, which the kernel drops when it dies (dskit/io/owner.py: pid reuse, containers and other hosts).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from dskit.errors import SpecError
from dskit.io import bounded_read, owner
from dskit.io.text import describe, first_unsafe
from dskit.launch.contract import RUN_YAML

#: Left in every directory dskit publishes; `--force` replaces only directories that have it.
MARKER = ".dskit-output"
#: what each kind of output is called in refusals (MARKER's "kind")
KINDS = {"run": "a rendered run directory", "data": "prepared data", "export": "an exported model"}
#: never deleted by --force, whatever MARKER says: someone's work lives there
REPOSITORIES = (".git", ".hg", ".svn")
TMP_TAG, OLD_TAG = ".dskit-tmp-", ".dskit-old-"


def check_replaceable(
    out: str | Path,
    *,
    force: bool,
    kind: str,
    inputs: Iterable[str | Path | None] = (),
    flag: str = "--output",
) -> Path:
    """The resolved destination, if the command may write it; SpecError otherwise (nothing written)."""
    if str(out) == "":
        raise SpecError(flag, "is empty; give a directory")
    try:
        if os.path.islink(out) and not os.path.exists(out):
            raise SpecError(flag, f"{out} is a link to nothing; give a directory, not a dangling link")
        out = Path(out).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise SpecError(flag, f"cannot resolve {out}: {e}") from None
    bad = first_unsafe(str(out))
    if bad is not None:  # the path is baked into scripts and printed: keep it one line
        raise SpecError(flag, f"{out} contains {describe(bad)}; choose a path without it")
    if not os.path.lexists(out):
        parent = next(p for p in out.parents if os.path.lexists(p))
        if not parent.is_dir():
            raise SpecError(flag, f"cannot create {out}: {parent} is not a directory")
        return out
    if not force:
        raise SpecError(flag, f"{out} already exists; pass --force to replace it")
    if not out.is_dir():
        raise SpecError(flag, f"{out} is not a directory; --force replaces only a directory dskit wrote")
    try:
        cwd = Path.cwd().resolve()
    except OSError:
        cwd = None
    if cwd is not None and (out == cwd or out in cwd.parents):
        raise SpecError(flag, f"{out} is the current directory or contains it; --force never replaces that")
    if not (out / MARKER).is_file():
        raise SpecError(
            flag,
            f"{out} was not written by dskit (no {MARKER} in it); --force replaces only dskit's own "
            "output: choose another directory or remove it yourself",
        )
    for p in inputs:
        if p is None:
            continue
        with contextlib.suppress(OSError, RuntimeError):
            if Path(p).resolve().is_relative_to(out):
                raise SpecError(
                    flag, f"{out} contains {p}, an input of this command; --force would delete it"
                )
    written = _kind_of(out)
    if written != kind:
        raise SpecError(
            flag,
            f"{out} holds {KINDS.get(written, 'output of unknown kind')}, not {KINDS[kind]}; --force replaces only the same "
            "kind of output: choose another directory",
        )
    for repo in REPOSITORIES:
        if os.path.lexists(out / repo):
            raise SpecError(flag, f"{out} contains {repo}; --force never deletes a repository")
    return out


def _marker_text(kind: str) -> str:
    info = {"written_by": "dskit", "kind": kind, **owner.identity()}
    return json.dumps(info) + "\n"


def _kind_of(d: Path) -> str | None:
    """The kind MARKER names; for a marker of dskit before kinds, what the directory holds."""
    kind = _marker(d).get("kind")
    if isinstance(kind, str) and kind in KINDS:
        return kind
    if kind is not None:
        return None
    if (d / RUN_YAML).is_file():
        return "run"
    if (d / "index.json").is_file():
        return "data"
    if (d / "config.json").is_file():
        return "export"
    return None


def _marker(d: Path) -> dict:
    try:
        info = bounded_read.read_json(d / MARKER, limit=64 << 10, what="dskit's marker")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _clean_stale(out: Path) -> None:
    """Remove our own leftovers beside `out`: builds whose writer died, and (if `out` exists) an old
    directory left aside by an interrupted non-atomic swap."""
    for d in _beside(out, TMP_TAG):
        if d.is_dir() and not d.is_symlink() and owner.gone(d / MARKER):
            shutil.rmtree(d, ignore_errors=True)
    if out.is_dir():
        for d in _beside(out, OLD_TAG):
            if d.is_dir() and not d.is_symlink() and (d / MARKER).is_file():
                shutil.rmtree(d, ignore_errors=True)


def _beside(out: Path, tag: str) -> list[Path]:
    """Entries of out's parent named `.{out.name}{tag}...`, compared literally (out.name may hold
    glob characters such as '*' or '[')."""
    prefix = f".{out.name}{tag}"
    try:
        return [p for p in out.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux renameat2); False where the system cannot."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(new: Path, out: Path) -> Path:
    """Put `new` at `out`, which exists; returns where the old directory now is (to delete)."""
    if _exchange(new, out):
        return new
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}{OLD_TAG}", dir=out.parent))
    os.rename(out, aside)  # onto the empty dir mkdtemp made: replaces it
    os.rename(new, out)
    return aside


@contextlib.contextmanager
def atomic_dir(
    out: str | Path,
    *,
    kind: str,
    force: bool = False,
    flag: str = "--output",
    inputs: Iterable[str | Path | None] = (),
) -> Iterator[Path]:
    """Yield a temporary sibling of `out` to fill; on success it replaces `out` (see the module doc)."""
    inputs = list(inputs)
    out = check_replaceable(out, force=force, kind=kind, inputs=inputs, flag=flag)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{TMP_TAG}", dir=out.parent))
    except OSError as e:
        raise SpecError(flag, f"cannot create {out}: {e.strerror or e}") from None
    lock = None
    try:
        lock = owner.hold(tmp / MARKER, _marker_text(kind))  # held until tmp is published or removed
        yield tmp
        _restore_marker(tmp, lock, _marker_text(kind))
        tmp.chmod(0o755)
        if os.path.lexists(out):
            check_replaceable(out, force=force, kind=kind, inputs=inputs, flag=flag)  # it may have appeared
            old = _swap_in(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _restore_marker(tmp: Path, lock: int, text: str) -> None:
    """The published directory carries MARKER even if the build replaced or removed it. Ours is left
    alone: opening and closing it again would drop the lock where flock is emulated by POSIX locks (NFS)."""
    try:
        if os.path.samestat(os.fstat(lock), os.lstat(tmp / MARKER)):
            return
    except OSError:
        pass
    (tmp / MARKER).write_text(text)


def write_file(path: Path, text: str) -> None:
    """Write one file all at once: a temporary file beside it, renamed into place, so a failed or killed
    write leaves the old file (or none), never a truncated one. OSError is the caller's to report."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.dskit-tmp-", dir=path.parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(fd, 0o666 & ~umask)  # what a plain open() would have made
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
