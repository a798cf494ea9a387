"""The checkpoint directory's names and its checks, without torch: the trainer
(dskit/train/checkpoints/store.py) writes checkpoints and re-checks its own files on resume; `dskit status`
and `dskit export` read them, the latter refusing a damaged run before it loads torch.

    step00000200/   one checkpoint; its DONE file (dskit.json) is written last, so its presence
                    means the checkpoint is complete
"""

from __future__ import annotations

import re
import sys
import zlib
from pathlib import Path
from typing import Any

from dskit.errors import SpecError
from dskit.io import bounded_read

TAG_RE = re.compile(r"^step(\d{8})$")
DONE = "dskit.json"
#: dskit.json holds the step, world size, layout and a little plan metadata: a few KiB
MAX_DONE = 1 << 20
#: a rank's manifest names each file it wrote with [size, crc]: tens of entries, a few KiB
MAX_MANIFEST = 16 << 20


def manifest_name(rank: int) -> str:
    return f"dskit-manifest-rank{rank}.json"


def read_manifest(d: Path, rank: int) -> Any:
    """Rank `rank`'s manifest in checkpoint `d`, parsed within its limits (OSError, ValueError)."""
    return bounded_read.read_json(d / manifest_name(rank), limit=MAX_MANIFEST, what="a rank's manifest")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def complete_tags(root: Path) -> list[str]:
    """Tags under `root` with a completion marker, newest first."""
    if not root.is_dir():
        return []
    return sorted(
        (p.name for p in root.iterdir() if TAG_RE.match(p.name) and (p / DONE).is_file()), reverse=True
    )


def crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify_rank_files(d: Path, rank: int) -> str | None:
    """What is wrong with the files `rank` wrote into checkpoint `d` (its manifest: sizes and CRC-32s),
    or None when they all check out."""
    mf = d / manifest_name(rank)
    if not mf.is_file():
        return f"{mf.name} missing"
    try:
        manifest = read_manifest(d, rank)
    except bounded_read.TooLarge as e:
        return f"{mf.name} {e.reason}"
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"{mf.name} unreadable"
    if not isinstance(manifest, dict):
        return f"{mf.name} is not a mapping of file names to [size, crc]"
    for name, entry in manifest.items():
        if not _plain_name(name):
            return f"{mf.name} names {name!r}, which is not a file inside the checkpoint"
        if not (isinstance(entry, list) and len(entry) == 2 and all(_is_int(x) for x in entry)):
            return f"{mf.name} has no [size, crc] for {name!r}"
        size, want = entry
        p = d / name
        try:
            if not p.is_file():
                return f"{name} missing"
            if p.stat().st_size != size:
                return f"{name} truncated ({p.stat().st_size} of {size} bytes)"
            if crc(p) != want:
                return f"{name} corrupt (checksum mismatch)"
        except OSError as e:  # EACCES, EIO, ESTALE: as untrustworthy as a corrupt file
            return f"{name} unreadable ({e.strerror or e})"
    return None


MAX_WORLD = 1 << 20


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _plain_name(name: object) -> bool:
    """A file name directly inside the checkpoint dir: no separators, not '.', '..' or empty."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def read_done(d: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the checkpoint's dskit.json, None), or (None, what is wrong with it)."""
    try:
        done = bounded_read.read_json(d / DONE, limit=MAX_DONE, what=f"a checkpoint's {DONE}")
    except FileNotFoundError:
        return None, f"{DONE} missing"
    except bounded_read.TooLarge as e:
        return None, f"{DONE} {e.reason}"
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"{DONE} unreadable (not JSON)"
    if not isinstance(done, dict):
        return None, f"{DONE} is not a mapping"
    world, step = done.get("world_size"), done.get("step")
    if not (_is_int(world) and 1 <= world <= MAX_WORLD):
        return None, f"{DONE} has no world_size (an integer from 1 to {MAX_WORLD})"
    if not (_is_int(step) and step >= 0):
        return None, f"{DONE} has no step (an integer from 0)"
    return done, None


def tag_problem(d: Path, ranks: range | list[int] | None = None) -> str | None:
    """What makes checkpoint `d` untrustworthy, or None: its dskit.json, then the files of `ranks`
    (default: every rank of the world it was written by). Resume (each rank its own) and export (all)
    share it."""
    done, problem = read_done(d)
    if problem:
        return problem
    for r in range(done["world_size"]) if ranks is None else ranks:
        if problem := verify_rank_files(d, r):
            return f"rank {r}: {problem}"
    return None


def newest_verified_tag(root: Path) -> Path:
    """The newest complete checkpoint whose every rank's files check out, in one process (export).
    A SpecError (exit 2) when there is none."""
    if not root.is_dir():
        raise SpecError("checkpoint", f"{root} does not exist: has the run saved a checkpoint?")
    skipped: list[str] = []
    for tag in complete_tags(root):
        d = root / tag
        problem = tag_problem(d)
        if problem is None:
            for line in skipped:  # the export goes ahead: say which newer ones it passed over
                print(f"dskit: skipping {line}", file=sys.stderr)
            return d
        skipped.append(f"{d}: {problem}")
    newest = f" (newest: {skipped[0]})" if skipped else ""
    raise SpecError("checkpoint", f"no complete checkpoint under {root}{newest}")


def intact(d: Path) -> bool:
    """Retention's quick check: dskit.json and every rank's manifest read, each file at its size (no
    checksums: retention runs at every save and must not re-read old checkpoints)."""
    done, problem = read_done(d)
    if problem:
        return False
    for r in range(done["world_size"]):
        try:
            manifest = read_manifest(d, r)
            if not isinstance(manifest, dict):
                return False
            for name, (size, _) in manifest.items():
                if not _plain_name(name) or (d / name).stat().st_size != size:
                    return False
        except (OSError, ValueError, TypeError):
            return False
    return True
