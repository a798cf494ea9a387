"""Resume on another world size or EP size: DeepSpeed's universal checkpoint of the tag, made once.

A ZeRO checkpoint's optimizer files are cut by data-parallel rank and its expert files by EP rank, so
DeepSpeed can load one only under the layout that wrote it. DeepSpeed 0.19.8 converts one, AutoEP's
experts included (`deepspeed/checkpoint/ds_to_universal.py`, `autoep_universal.py`), into files per
parameter (fp32 master, Adam moments) that any world and EP size slice on load
(`checkpoint.load_universal`). A preempted job that comes back on fewer or more nodes therefore keeps
its optimizer state instead of starting over.

The conversion runs once per tag, on rank 0, in a child process, into
`<checkpoint_dir>/universal/<tag>` (written under `universal/tmp/` and renamed, so a half-made copy is
never loaded); the other ranks wait on the shared file system, not in a collective (a conversion can
outlast the collective timeout), and every rank beats the watchdog while it waits. The copy is removed
once the run has saved a checkpoint of its own layout (`Checkpointer.save`).

Full fine-tuning reshards, under every ZeRO stage and either optimizer step (DeepSpeed's, or torch's
fused AdamW inside ZeRO-1/2): tests/test_reshard.py and test_zero_stages.py resume each across world
and EP sizes on the curve of the uninterrupted run. A LoRA run does not: its optimizer files are
dskit's own (adapter_state.py), cut by rank, and the converter cannot read them; it is refused in one
line as before.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from dskit.errors import SpecError
from dskit.text import escape
from dskit.train import universal

log = logging.getLogger("dskit.train")

UNIVERSAL_DIR = "universal"
#: where rank 0 writes the reason when a conversion fails, for the ranks waiting on it
FAILED = "{tag}.failed"
POLL_S = 1.0


def moved(written: dict, world: int, ep_size: int | None) -> list[str]:
    """What of the layout a resume would change that the universal checkpoint absorbs: the world size
    and the EP size, as 'world size 2 -> 1' phrases (empty: load the tag as it is)."""
    out = []
    if written["world_size"] != world:
        out.append(f"world size {written['world_size']} -> {world}")
    was = (written.get("layout") or {}).get("ep_size")
    if was is not None and ep_size is not None and was != ep_size:
        out.append(f"ep size {was} -> {ep_size}")
    return out


def universal_root(root: Path) -> Path:
    return root / UNIVERSAL_DIR


def clear_stale(root: Path) -> None:
    """Rank 0, before the start's barrier: a failure marker or a half-made copy from an earlier attempt
    must not be read by this one's waiting ranks."""
    out = universal_root(root)
    for marker in out.glob(FAILED.format(tag="*")):
        marker.unlink(missing_ok=True)
    shutil.rmtree(out / "tmp", ignore_errors=True)


def convert(
    root: Path,
    tag: str,
    change: str,
    *,
    rank: int,
    beat: Callable[[str], None],
    free_bytes: Callable[[], int],
    needed_bytes: int,
    disk_full: Callable[[int, int], Exception],
) -> Path:
    """The directory holding `tag`'s universal copy (made now by rank 0 unless it exists); every rank
    returns once it is complete, or raises what failed rank 0's conversion (a SpecError with the
    converter's last line; DiskFull where the copy would not fit)."""
    out = universal_root(root)
    final, failed = out / tag, out / FAILED.format(tag=tag)
    if rank == 0 and not final.is_dir():
        try:
            _run_converter(root / tag, out, tag, change, beat, free_bytes, needed_bytes, disk_full)
        except BaseException as e:  # the waiting ranks must not wait for ever
            shutil.rmtree(out / "tmp", ignore_errors=True)  # nothing half-made stays; the log does
            out.mkdir(parents=True, exist_ok=True)
            why = {"field": e.field, "message": e.message} if isinstance(e, SpecError) else {"error": str(e)}
            failed.write_text(json.dumps(why))
            raise
    while not final.is_dir():
        if failed.is_file():
            raise _failure(json.loads(failed.read_text()))
        beat(f"waiting for the universal copy of {tag}")
        time.sleep(POLL_S)
    return out


class ConversionFailed(Exception):
    """What a waiting rank raises when rank 0's conversion failed other than for bad input (a full disk,
    a crash): the trainer then leaves the verdict to rank 0's own exit code (entry.py)."""


def _failure(why: dict) -> Exception:
    if "field" in why:
        return SpecError(why["field"], why["message"])
    return ConversionFailed(f"rank 0 could not convert the checkpoint: {why['error']}")


def _run_converter(
    src: Path, out: Path, tag: str, change: str, beat, free_bytes, needed_bytes: int, disk_full
) -> None:
    tmp = out / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a conversion killed part way
    tmp.mkdir(parents=True)
    free = free_bytes()
    if free < needed_bytes:
        raise disk_full(needed_bytes, free)
    logfile = out / f"convert-{tag}.log"
    log.info("resharding: converting %s to DeepSpeed's universal layout in %s (log: %s)", src, out, logfile)
    t0 = time.perf_counter()
    with logfile.open("w") as f:
        p = subprocess.Popen(
            universal.command(src, tmp / tag), env=universal.environment(), stdout=f, stderr=subprocess.STDOUT
        )
        try:
            while p.poll() is None:
                beat(f"converting {tag} to the universal layout")
                try:
                    p.wait(timeout=POLL_S)
                except subprocess.TimeoutExpired:
                    pass
        finally:  # this rank is going down: no converter left writing behind it
            if p.poll() is None:
                p.kill()
                p.wait()
    if p.returncode != 0:
        text = logfile.read_text(errors="replace")
        if "No space left on device" in text or "Disk quota exceeded" in text:
            raise disk_full(needed_bytes, free_bytes())
        lines = [ln for ln in text.splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else f"exit code {p.returncode}"
        raise SpecError(
            "hardware",
            f"checkpoint {escape(str(src))} could not be converted for {change} (DeepSpeed's "
            f"ds_to_universal: {escape(last[:300])}; log {escape(str(logfile))}): render the run with the "
            "layout of the checkpoint, or point storage.checkpoint_dir at an empty dir to start fresh",
        )
    (tmp / tag).rename(out / tag)
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("resharding: %s converted in %.1f s", tag, time.perf_counter() - t0)


def remove(root: Path) -> None:
    """Drop the universal copies: a checkpoint of the run's own layout now exists."""
    shutil.rmtree(universal_root(root), ignore_errors=True)
