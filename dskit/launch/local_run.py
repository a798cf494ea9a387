"""The record `dskit train --local` keeps of its run in the run directory, for `dskit status`.

A cluster run is found through its scheduler (the run dir's `jobs` file); a run started here has none,
so its launcher writes RECORD beside run.yaml: who runs it (dskit/io/owner.py's identity: host, pid, boot
id), when it started and, once torchrun has returned, when it ended and with which exit code. The file
is replaced whole, never written in place, so a reader never sees half of it. While the launcher runs it
holds an exclusive lock on the record, which the kernel drops when the launcher dies, kill -9 included:
a record without an end whose lock is free is a run that was killed before it could say so, however
its pid has been reused since (owner.gone; a record of another machine cannot be checked from here).

Torch-free: the reader runs on a login node with dskit's core only.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dskit.errors import EXIT_BAD_INPUT, SpecError
from dskit.io import bounded_read, owner
from dskit.io.atomic import write_file
from dskit.launch.contract import EXIT_DISK_FULL, EXIT_REQUEUE, LOCAL_RUN_FILE
from dskit.launch.torchrun import signal_name

RECORD = LOCAL_RUN_FILE
#: a dozen short fields: anything near this is not a record
MAX_RECORD = 64 << 10
WRITER = "dskit train --local"
#: what an exit code of the trainer means, in a local run's state
ENDS = {
    0: ("finished", "exit 0"),
    EXIT_REQUEUE: ("stopped", f"checkpointed on request (exit {EXIT_REQUEUE}); the same command resumes"),
    EXIT_BAD_INPUT: ("failed", f"bad input (exit {EXIT_BAD_INPUT}): the error line is in its output"),
    EXIT_DISK_FULL: ("failed", f"checkpoint disk full (exit {EXIT_DISK_FULL})"),
}


#: beside the record, never replaced: the one launcher that holds its lock trains the run dir
RUN_LOCK = ".local-run.lock"


@dataclass(frozen=True)
class Started:
    """A local run's record while it runs: the descriptors hold the record's and the run dir's locks
    until `end` closes them."""

    path: Path
    fd: int
    info: dict[str, Any]
    run_lock: int | None = None


def _warn(text: str) -> None:
    # the record serves `dskit status` only: a run dir that cannot hold it must not stop the training
    sys.stderr.write(f"dskit: warning: {text}; `dskit status` will not see this run\n")


def refuse_while_trained(run_dir: Path, why: str) -> None:
    """SpecError (exit 2) where the record says a local run of `run_dir` is still running (`why`: what
    going on would do to it). A record of another machine cannot be checked from here and is refused
    too; every refusal names the record to delete if that run is gone (a pid reused since, a host
    renamed)."""
    run = read(run_dir)
    if run is None or run.state not in ("running", "running?"):
        return
    stop = "kill -USR1 on its pid checkpoints and stops it; " if run.state == "running" else ""
    raise SpecError(
        str(run_dir),
        f"being trained ({run.detail}): {why}; {stop}if that run is gone, delete {run_dir / RECORD}",
    )


def _lock_run_dir(run_dir: Path) -> int | None:
    """Hold the run dir's lock for this launcher (SpecError where another launcher holds it; None where
    the run dir cannot hold a lock file: the record is then the only guard)."""
    try:
        fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SpecError(
            str(run_dir),
            "being trained by another `dskit train --local` that started just now: wait for it or stop it",
        ) from None
    except OSError:  # a filesystem without locks
        pass
    return fd


def start(run_dir: Path) -> Started | None:
    """Take the run dir for this launcher (SpecError where a live one on this machine has it: two that
    passed `refuse_while_trained` together) and record that a local run starts now, locked until `end`;
    None where the record cannot be written."""
    run_lock = _lock_run_dir(run_dir)
    path = run_dir / RECORD
    info = {"written_by": WRITER, **owner.identity(), "started": time.time()}
    tmp = run_dir / f".{RECORD}.{os.getpid()}.tmp"
    fd = None
    try:
        tmp.unlink(missing_ok=True)  # this pid's leftover from a launcher killed between these lines
        fd = owner.hold(tmp, json.dumps(info) + "\n")  # locked before it is filled, then moved into place
        os.replace(tmp, path)
    except OSError as e:
        if fd is not None:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        if run_lock is not None:
            os.close(run_lock)
        _warn(f"cannot write {path} ({e.strerror or e})")
        return None
    return Started(path, fd, info, run_lock)


def end(started: Started | None, code: int | None, interrupted: str | None = None) -> None:
    """Record how the run ended (`code`: the launcher's exit code; None with `interrupted`: the
    exception that stopped the launcher itself), then let go of the lock."""
    if started is None:
        return
    info = {**started.info, "ended": time.time(), "exit_code": code}
    if interrupted:
        info["interrupted"] = interrupted
    try:
        write_file(started.path, json.dumps(info) + "\n")
    except OSError as e:
        _warn(f"cannot record the end of the run in {started.path} ({e.strerror or e})")
    finally:
        os.close(started.fd)
        if started.run_lock is not None:
            os.close(started.run_lock)


@dataclass(frozen=True)
class LocalRun:
    """What a record says, as `dskit status` shows it."""

    state: str  # running, finished, stopped, failed, killed; "running?" where this machine cannot check
    detail: str

    @property
    def running(self) -> bool | None:
        """For the ETA: True, False, or None where it cannot be known from here."""
        return None if self.state == "running?" else self.state == "running"

    def text(self) -> str:
        return f"{self.state}: {self.detail}"


#: Linux's largest pid (pid_max's ceiling, 2^22): a larger one is no process of any host
PID_MAX = 2**22
#: the times a record holds, seconds since the epoch: from 2020 to 2200, anything else is damage
EPOCH_RANGE = (1.577e9, 7.26e9)


def _time(x: object) -> bool:
    return type(x) in (int, float) and EPOCH_RANGE[0] <= x <= EPOCH_RANGE[1]  # NaN and inf fail too


def _load(path: Path) -> dict[str, Any]:
    try:
        info = bounded_read.read_json(path, limit=MAX_RECORD, what=f"a {RECORD}")
    except bounded_read.TooLarge as e:
        raise SpecError(str(path), e.reason) from None
    except (OSError, ValueError) as e:
        raise SpecError(
            str(path), f"unreadable ({e}); delete it (it records a local run for `dskit status`)"
        ) from None
    ok = (
        isinstance(info, dict)
        and _time(info.get("started"))
        and type(info.get("pid")) is int
        and 0 < info["pid"] <= PID_MAX
        and isinstance(info.get("host"), str)
        and (
            info.get("exit_code") is None
            or (type(info["exit_code"]) is int and -255 <= info["exit_code"] <= 255)
        )
        and ("ended" not in info or _time(info["ended"]))
    )
    if not ok:
        raise SpecError(
            str(path), f"is not a record of {WRITER}; delete it (it records a local run for `dskit status`)"
        )
    return info


def read(run_dir: Path, now: float | None = None) -> LocalRun | None:
    """The local run recorded in `run_dir`, None where there is none; SpecError for a damaged record."""
    from dskit.train.progress import format_eta  # torch-free

    path = run_dir / RECORD
    if not path.is_file():
        return None
    now = time.time() if now is None else now
    info = _load(path)
    gone = "ended" not in info and owner.gone(path)
    if gone:
        info = _load(path)  # the launcher may have recorded its end since the first read
    who = f"pid {info['pid']} on {info['host']}"
    started = f"started {format_eta(max(0.0, now - info['started']))} ago"
    if "ended" not in info:
        me = owner.identity()
        if not gone and info.get("boot_id") != me["boot_id"] and info["host"] != me["host"]:
            return LocalRun("running?", f"{WRITER}, {who}, {started} (another machine: not checkable here)")
        if not gone:  # its lock is held (or, without locks, its pid runs on this host)
            return LocalRun("running", f"{WRITER}, {who}, {started}")
        return LocalRun(
            "killed",
            f"{WRITER} ({who}) ended without recording an exit: killed (kill -9) or its machine went down; "
            f"{started}",
        )
    ran = f"ran {format_eta(max(0.0, info['ended'] - info['started']))}"
    ended = f"ended {format_eta(max(0.0, now - info['ended']))} ago"
    state, why = _ending(info.get("exit_code"), info.get("interrupted"))
    return LocalRun(state, f"{WRITER}, {why}, {ran}, {ended}")


def _ending(code: int | None, interrupted: Any) -> tuple[str, str]:
    """(state, why) from the launcher's exit code: the trainer's own codes (contract), a signal that
    stopped torchrun (negative: it was killed; 128 + N: its agent was stopped and exited so), else a
    failure whose output says why."""
    if code is None:
        return "failed", f"the launcher was interrupted ({interrupted or 'no reason recorded'})"
    if code in ENDS:
        return ENDS[code]
    if code < 0:
        return "failed", f"torchrun was killed by {signal_name(-code)}"
    if code > 128 and code - 128 in {s.value for s in signal.Signals}:
        return "failed", f"torchrun was stopped by {signal_name(code - 128)} (exit {code})"
    return "failed", f"exit {code}: its output says why"
