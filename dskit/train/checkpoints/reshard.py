"""Resume on another world size or EP size: DeepSpeed's universal checkpoint of the tag, made once.

A ZeRO checkpoint's optimizer files are cut by data-parallel rank and its expert files by EP rank, so
DeepSpeed can load one only under the layout that wrote it. DeepSpeed 0.19.8 converts one, AutoEP's
experts included (`deepspeed/checkpoint/ds_to_universal.py`, `autoep_universal.py`), into files per
parameter (fp32 master, Adam moments) that any world and EP size slice on load
(`checkpoint.load_universal`). A preempted job that comes back on fewer or more nodes therefore keeps
its optimizer state instead of starting over.

The conversion runs once per tag, on rank 0, in a child process (dskit/train/checkpoints/universal.py), into
`<checkpoint_dir>/universal/<tag>`: written under `universal/tmp-<pid>/` and renamed, so a half-made
copy is never loaded. The child ignores the job's stop signals (the trainer turns them into a checkpoint
and exit 75 at its first step, as for any stop during start-up) and dies with its parent (no orphan
writes on behind it). The other ranks wait on the shared file system, not in a collective (a conversion
can outlast the collective timeout). Every rank beats the watchdog only while the conversion shows
progress (its log or its output growing), so a wedged converter still ends the run with 75. The copy
is removed once the run has saved a checkpoint of its own layout (`Checkpointer.save`), renamed away
first so that no half-deleted copy is ever taken for a whole one.

Scale: one process converts every rank's optimizer files (12 bytes per parameter read, and written
again); at DeepSeek-V3's size that is hours while the GPUs wait, and DeepSpeed's universal load then
reads each parameter's whole file on every rank. Meant for a run that must continue on other nodes,
not for every restart.

Full fine-tuning reshards: tests/train/test_reshard.py (ZeRO-3, DeepSpeed's step) and test_zero_stages.py
(ZeRO-1/2, torch's fused AdamW) resume across world and EP sizes on the curve of the uninterrupted run;
ZeRO-3 with the optimizer offloaded was checked the same way once, by hand. A LoRA run does not: its optimizer files are
dskit's own (adapter_state.py), cut by rank, and the converter cannot read them; it is refused in one
line as before.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dskit.errors import SpecError
from dskit.io import bounded_read
from dskit.io.text import escape
from dskit.train.checkpoints import universal

log = logging.getLogger("dskit.train")

UNIVERSAL_DIR = "universal"
#: where rank 0 writes the reason when a conversion fails, for the ranks waiting on it
FAILED = "{tag}.failed"
#: rank 0's record of a failed conversion: a field and a one-line message
MAX_FAILURE = 64 << 10
#: how much of the converter's log a failure reads (its last lines name what went wrong)
LOG_TAIL = 1 << 20
#: what a removed copy is renamed to before it is deleted (a crash mid-delete leaves only this)
TRASH = "universal.removed-{pid}"
POLL_S = 2.0
#: Linux prctl option: the signal a child gets when its parent dies
PR_SET_PDEATHSIG = 1


def moved(written: dict, world: int, ep_size: int | None) -> list[str]:
    """What of the layout a resume would change that the universal checkpoint absorbs: the world size
    and the EP size, as 'world size 2 -> 1' phrases (empty: load the tag as it is)."""
    out = []
    if written["world_size"] != world:
        out.append(f"world size {written['world_size']} -> {world}")
    layout = written.get("layout")
    was = layout.get("ep_size") if isinstance(layout, dict) else None
    if was is not None and ep_size is not None and was != ep_size:
        out.append(f"ep size {was} -> {ep_size}")
    return out


def universal_root(root: Path) -> Path:
    return root / UNIVERSAL_DIR


def clear_stale(root: Path) -> None:
    """Rank 0, before the start's barrier: failure markers, half-made copies and removed copies from an
    earlier attempt must not be read by this one's waiting ranks (nor fill the disk)."""
    out = universal_root(root)
    for marker in out.glob(FAILED.format(tag="*")):
        marker.unlink(missing_ok=True)
    for stale in [*out.glob("tmp-*"), *root.glob(TRASH.format(pid="*"))]:
        shutil.rmtree(stale, ignore_errors=True)


class ConversionFailed(Exception):
    """A conversion that failed other than for bad input or a full disk (the converter killed, rank 0
    gone). `code`: rank 0's exit code (1, counted against the retries); None on a waiting rank, which
    leaves the verdict to rank 0's own (entry.py)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


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
    converter's last line, DiskFull, or ConversionFailed)."""
    out = universal_root(root)
    final, failed = out / tag, out / FAILED.format(tag=tag)
    if rank == 0 and not final.is_dir():
        try:
            _run_converter(root / tag, out, tag, change, beat, free_bytes, needed_bytes, disk_full)
        except BaseException as e:  # the waiting ranks must not wait for ever
            why = {"field": e.field, "message": e.message} if isinstance(e, SpecError) else {"error": str(e)}
            _write_atomic(failed, json.dumps(why))
            raise
    progress = _Progress(out)
    while not final.is_dir():
        if (why := _read_failure(failed)) is not None:
            raise why
        if progress.moved():
            beat(f"waiting for the universal copy of {tag}")
        time.sleep(POLL_S)
    return out


def remove(root: Path) -> None:
    """Drop the universal copies, a checkpoint of the run's own layout now existing: renamed away at
    once, deleted in the background (at scale, tens of thousands of files that no rank should wait
    for); a removal cut short is finished by the next start (`clear_stale`)."""
    out = universal_root(root)
    if not out.exists():
        return
    trash = root / TRASH.format(pid=os.getpid())
    try:
        os.rename(out, trash)
    except OSError as e:  # the checkpoint just saved is whole; the copy only costs disk until next time
        log.warning("could not remove the universal copies in %s: %s", out, e)
        return
    threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True).start()


class _Progress:
    """Has the conversion under `out` moved since the last look? Its log and the directories it adds
    to (DeepSpeed's extraction writes under its output's `tmp/`, the merge under `zero/`)."""

    def __init__(self, out: Path):
        self.out, self.seen = out, None

    def moved(self) -> bool:
        now = []
        for p in [*self.out.glob("convert-*.log"), *self.out.glob("tmp-*/*"), *self.out.glob("tmp-*/*/*")]:
            try:
                st = p.stat()
            except OSError:
                continue
            now.append((p.name, st.st_size if p.is_file() else 0, st.st_mtime_ns))
        changed = now != self.seen
        self.seen = now
        return changed


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_failure(failed: Path) -> Exception | None:
    try:
        why = bounded_read.read_json(failed, limit=MAX_FAILURE, what="a failed conversion's record")
    except FileNotFoundError:
        return None
    except bounded_read.TooLarge as e:
        return ConversionFailed(f"rank 0's record of its failed conversion: {e}")
    except (OSError, ValueError):  # being replaced right now: the next look reads it whole
        return None
    if not isinstance(why, dict):
        return ConversionFailed(f"rank 0's record of its failed conversion, {failed}, is not a mapping")
    if "field" in why:
        return SpecError(why["field"], why.get("message"))
    return ConversionFailed(f"rank 0 could not convert the checkpoint: {why.get('error')}")


def _child_setup() -> None:
    """In the converter, before it runs: ignore the job's stop signals (the trainer checkpoints after
    its first step instead) and die with the trainer (Linux prctl; elsewhere the launcher's kill of
    the process group stays the only guard)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _run_converter(
    src: Path, out: Path, tag: str, change: str, beat, free_bytes, needed_bytes: int, disk_full
) -> None:
    tmp = out / f"tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        free = free_bytes()
        if free < needed_bytes:
            raise disk_full(needed_bytes, free)
        logfile = out / f"convert-{tag}.log"
        log.info(
            "resharding: converting %s to DeepSpeed's universal layout in %s (log: %s)", src, out, logfile
        )
        t0 = time.perf_counter()
        progress = _Progress(out)
        with logfile.open("w") as f:
            p = subprocess.Popen(
                universal.command(src, tmp / tag),
                env=universal.environment(),
                stdout=f,
                stderr=subprocess.STDOUT,
                preexec_fn=_child_setup,
            )
            try:
                while p.poll() is None:
                    if progress.moved():
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
            _raise_failure(src, logfile, p.returncode, change, free_bytes, needed_bytes, disk_full)
        (tmp / tag).rename(out / tag)
        log.info("resharding: %s converted in %.1f s", tag, time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-made stays; the log does


def _raise_failure(
    src: Path, logfile: Path, code: int, change: str, free_bytes, needed: int, disk_full
) -> None:
    with logfile.open("rb") as f:  # its end: the converter's last words, however long the log grew
        f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL))
        text = f.read().decode(errors="replace")
    free = free_bytes()
    # torch.save's zip writer names no errno ("file write failed"): a disk left all but full says it
    if "No space left on device" in text or "Disk quota exceeded" in text or free < 16 * 2**20:
        raise disk_full(needed, free)
    if code < 0:  # killed (the OOM killer, an operator): not the checkpoint's fault, so retried
        raise ConversionFailed(
            f"the converter of {src} was killed by {signal.Signals(-code).name} (log {logfile})", code=1
        )
    lines = [ln for ln in text.splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else f"exit code {code}"
    raise SpecError(
        "hardware",
        f"checkpoint {escape(str(src))} could not be converted for {change} (DeepSpeed's "
        f"ds_to_universal: {escape(last[:300])}; log {escape(str(logfile))}): render the run with the "
        "layout of the checkpoint, or point storage.checkpoint_dir at an empty dir to start fresh",
    )
