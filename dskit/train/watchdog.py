"""A watchdog for hung ranks: when this rank has made no progress for `run.watchdog_timeout_s`, it says
which rank stopped responding, dumps its own stacks, and exits so the job restarts from the last
checkpoint.

Why every rank watches itself: a rank that hangs (SIGSTOP, a frozen host, a stuck kernel, a wedged
communicator) cannot report anything, but every other rank soon blocks in the next collective waiting
for it and stops making progress too. Their watchdogs fire, they exit, and the launcher tears the hung
rank down (torchrun kills its workers, srun --kill-on-bad-exit its tasks, Ray its worker group).

The exit code says whether a restart can help. EXIT_REQUEUE (75) when this attempt finished at least
one step: the hang came after progress, as a lost peer or a flaky link does, and the scheduler restarts
the job from the last checkpoint. 1 (a failure, counted against the retry budget) when it hangs before
its first step: the same hang would recur at every restart, and 75 would requeue it for ever.

Each rank's progress is also a heartbeat file (OUTPUT_DIR/heartbeats/rank{R}.json: last step and
phase, host, pid, and an `alive` stamp the watchdog thread refreshes at every poll). A rank whose
process is frozen lets `alive` go stale, so the one-line reason names it and where it runs; a rank
stuck inside a kernel or collective keeps its thread alive, and the line says every rank is waiting.

The timeout is the plan's (dskit/plan/hang_timeout.py); collectives time out COLLECTIVE_GRACE_S later, so
the watchdog, which names the rank, fires first.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dskit.io import bounded_read
from dskit.launch.contract import EXIT_REQUEUE, record_exit

log = logging.getLogger("dskit.train")
HEARTBEAT_DIR = "heartbeats"
#: a heartbeat is a handful of numbers and a host name
MAX_HEARTBEAT = 64 << 10
#: OUTPUT_DIR/watchdog-rank{R}.log: the reason and this rank's stacks when its watchdog fired.
REPORT_FILE = "watchdog-rank{rank}.log"
#: Exit code of a hang before the attempt's first step (see the module docstring).
EXIT_HUNG_AT_START = 1
#: How long the firing watchdog waits on the shared filesystem (heartbeats, its report): a stuck
#: mount must not keep it from ending the process.
SHARED_FS_WAIT_S = 10.0


class Watchdog:
    """`with Watchdog(...) as dog:` around resume and the training loop, which call
    `dog.beat(step, phase)`; a daemon thread checks the time since the last beat.

    `on_fire(code)` ends the process (tests pass their own); by default it records the code for the
    launcher and exits at once: the main thread is stuck, so nothing can unwind it."""

    def __init__(
        self,
        timeout_s: float,
        output_dir: str,
        rank: int,
        *,
        poll_s: float | None = None,
        on_fire: Callable[[int], None] | None = None,
    ):
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.dir = Path(output_dir, HEARTBEAT_DIR)
        self.report = Path(output_dir, REPORT_FILE.format(rank=rank))
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.2, self.timeout_s / 20))
        self.on_fire = on_fire or _exit
        self._beat = (time.monotonic(), time.time(), 0, "resume")  # (mono, wall, step, phase)
        self.start_step: int | None = None  # set by begin(): the step this attempt resumed at
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dskit-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_heartbeat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def beat(self, step: int, phase: str = "step") -> None:
        """Progress: `step` steps are done and the rank is now in `phase` (cheap: one tuple store)."""
        self._beat = (time.monotonic(), time.time(), step, phase)

    def begin(self, start: int) -> None:
        """The loop starts at step `start` (resumed): progress is counted from here."""
        self.start_step = start
        self.beat(start, "first step")

    @property
    def progressed(self) -> bool:
        """Did this attempt finish a step? (Decides 75 against 1, see the module docstring.)"""
        return self.start_step is not None and self._beat[2] > self.start_step

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll_s * 4)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        woke = time.monotonic()
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            if now - woke > max(30.0, 10 * self.poll_s):
                # This thread slept far past its poll: the whole process was suspended (scontrol
                # suspend, gang scheduling), not hung. Its peers were suspended with it.
                mono, wall, step, phase = self._beat
                self._beat = (mono + (now - woke), wall + (now - woke), step, phase)
            woke = now
            if now - self._beat[0] > self.timeout_s:
                self._fire()
                return
            self._write_heartbeat()

    def _write_heartbeat(self) -> None:
        _, wall, step, phase = self._beat
        rec = {
            "rank": self.rank,
            "step": step,
            "phase": phase,
            "time": wall,
            "alive": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        tmp = self.dir / f".rank{self.rank}.json.tmp"
        try:
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, self.dir / f"rank{self.rank}.json")
        except OSError:  # a full or read-only disk must not stop training: the heartbeat is diagnostic
            pass

    def reason(self, beats: dict[int, dict] | None) -> str:
        """One line: how long this rank has waited, and which ranks' heartbeats went stale."""
        _, wall, step, phase = self._beat
        now = time.time()
        here = (
            f"rank {self.rank} made no progress for {now - wall:.0f} s (timeout {self.timeout_s:g} s) "
            f"after step {step} ({phase})"
        )
        if beats is None:
            return f"{here}; the heartbeats in {self.dir} could not be read within {SHARED_FS_WAIT_S:g} s"
        stale_after = max(
            10.0, 4 * self.poll_s
        )  # a live rank refreshes every poll; clocks may differ a little
        hung = sorted(r for r, b in beats.items() if now - b["alive"] > stale_after)
        if not hung:
            return f"{here}; every rank with a heartbeat is alive and waiting: a collective, kernel or the filesystem is stuck"
        who = ", ".join(
            f"rank {r} on {beats[r].get('host', '?')} (pid {beats[r].get('pid', '?')}, silent for "
            f"{now - beats[r]['alive']:.0f} s, after step {beats[r]['step']} ({beats[r].get('phase', '?')}))"
            for r in hung[:4]
        )
        more = f" and {len(hung) - 4} more" if len(hung) > 4 else ""
        return f"{here}; not responding: {who}{more}"

    def _fire(self) -> None:
        code = EXIT_REQUEUE if self.progressed else EXIT_HUNG_AT_START
        then = (
            f"exiting {code} to restart from the last checkpoint"
            if code == EXIT_REQUEUE
            else f"exiting {code}: no step finished since the start, so a restart would hang the same way"
        )
        line = f"dskit: watchdog: {self.reason(_within(SHARED_FS_WAIT_S, read_heartbeats, self.dir))}; {then}"
        os.write(2, (line + "\n").encode())  # one write: ranks share the launcher's stderr
        stacks = _stacks()
        os.write(2, f"dskit: watchdog: rank {self.rank}'s stacks:\n{stacks}".encode())
        _within(SHARED_FS_WAIT_S, self.report.write_text, f"{line}\n{stacks}")
        self.on_fire(code)


def _stacks() -> str:
    """All threads' stacks as text (faulthandler writes to a file descriptor, not a string)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def _within(seconds: float, fn: Callable, *args):
    """fn(*args) in a daemon thread, or None when it has not returned in time (a stuck mount) or raised."""
    out: list = []

    def call() -> None:
        try:
            out.append(fn(*args))
        except Exception:  # noqa: BLE001 - diagnostics only: the watchdog must go on to exit
            pass

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else None


def read_heartbeats(directory: Path) -> dict[int, dict]:
    """rank -> its last heartbeat; unreadable or half-written files are left out."""
    out: dict[int, dict] = {}
    if not directory.is_dir():
        return out
    for p in directory.glob("rank*.json"):
        try:
            rec = bounded_read.read_json(p, limit=MAX_HEARTBEAT, what="a heartbeat")
            out[int(rec["rank"])] = {
                **rec,
                "step": int(rec["step"]),
                "time": float(rec["time"]),
                "alive": float(rec["alive"]),
            }
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _exit(code: int) -> None:
    record_exit(code)
    os._exit(code)
