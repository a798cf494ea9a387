"""A watchdog for hung ranks: when this rank has made no progress for `run.watchdog_timeout_s`, it says
which rank is behind, dumps its own stacks, and exits with the requeue code.

Why every rank watches itself: a rank that hangs (SIGSTOP, a stuck kernel, a wedged communicator)
cannot report anything, but every other rank soon blocks in the next collective waiting for it, and
stops making progress too. Their watchdogs fire, they exit EXIT_REQUEUE, and the launcher tears the
hung rank down (torchrun kills its workers, srun --kill-on-bad-exit its tasks, Ray its worker group):
the scheduler restarts the job from the last checkpoint, as after a preemption.

Each rank's progress is also a heartbeat file (OUTPUT_DIR/heartbeats/rank{R}.json: last step, time,
host, pid), written by the watchdog thread and not the training loop, so that the one-line reason can
name the rank that fell behind and where it runs.

The timeout is the plan's (dskit/plan/watchdog.py: derived from the predicted step and checkpoint save
times); the collective timeout of the process group is the same number (entry.start_distributed), so a
communicator that errors instead of hanging ends the same way.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dskit.contract import EXIT_REQUEUE

log = logging.getLogger("dskit.train")
HEARTBEAT_DIR = "heartbeats"
#: OUTPUT_DIR/watchdog-rank{R}.log: the reason and this rank's stacks when its watchdog fired.
REPORT_FILE = "watchdog-rank{rank}.log"


class Watchdog:
    """`with Watchdog(...) as dog:` around the training loop, which calls `dog.beat(step, phase)`; a
    daemon thread checks the time since the last beat.

    `on_fire` ends the process (tests pass their own); by default it records EXIT_REQUEUE for the
    launcher and exits at once: the main thread is stuck, so nothing can unwind it."""

    def __init__(
        self,
        timeout_s: float,
        output_dir: str,
        rank: int,
        *,
        poll_s: float | None = None,
        on_fire: Callable[[], None] | None = None,
    ):
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.dir = Path(output_dir, HEARTBEAT_DIR)
        self.report = Path(output_dir, REPORT_FILE.format(rank=rank))
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.2, self.timeout_s / 20))
        self.on_fire = on_fire or _exit_requeue
        self._beat = (time.monotonic(), time.time(), 0, "start")  # (mono, wall, step, phase)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dskit-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.beat(0, "resume")
        self._write_heartbeat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def beat(self, step: int, phase: str = "step") -> None:
        """Progress: `step` steps are done and the rank is now in `phase` (cheap: one tuple store)."""
        self._beat = (time.monotonic(), time.time(), step, phase)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll_s * 4)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._write_heartbeat()
            if time.monotonic() - self._beat[0] > self.timeout_s:
                self._fire()
                return

    def _write_heartbeat(self) -> None:
        """This thread's own liveness (`alive`) and the loop's progress (`step`, `phase`, `time`): a rank
        that is waiting keeps `alive` fresh; a stopped or GIL-stuck one lets it go stale."""
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

    def reason(self) -> str:
        """One line: how long this rank has waited, and which ranks' heartbeats went stale."""
        _, wall, step, phase = self._beat
        now = time.time()
        here = (
            f"rank {self.rank} made no progress for {now - wall:.0f} s (timeout {self.timeout_s:g} s) "
            f"after step {step} ({phase})"
        )
        beats = read_heartbeats(self.dir)
        stale_after = max(
            10.0, 4 * self.poll_s
        )  # a live rank refreshes every poll; clocks may differ a little
        hung = sorted(r for r, b in beats.items() if now - b["alive"] > stale_after)
        if hung:
            who = ", ".join(
                f"rank {r} on {beats[r].get('host', '?')} (pid {beats[r].get('pid', '?')}, silent for "
                f"{now - beats[r]['alive']:.0f} s, after step {beats[r]['step']} ({beats[r].get('phase', '?')}))"
                for r in hung[:4]
            )
            more = f" and {len(hung) - 4} more" if len(hung) > 4 else ""
            return f"{here}; not responding: {who}{more}"
        return f"{here}; every rank with a heartbeat is alive and waiting: a collective or the filesystem is stuck"

    def _fire(self) -> None:
        line = f"dskit: watchdog: {self.reason()}; exiting {EXIT_REQUEUE} to restart from the last checkpoint"
        try:
            with self.report.open("w") as f:
                f.write(line + "\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            pass
        os.write(2, (line + "\n").encode())  # one write: ranks share the launcher's stderr
        os.write(2, f"dskit: watchdog: rank {self.rank}'s stacks:\n".encode())
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.on_fire()


def read_heartbeats(directory: Path) -> dict[int, dict]:
    """rank -> its last heartbeat; unreadable or half-written files are left out."""
    out: dict[int, dict] = {}
    if not directory.is_dir():
        return out
    for p in directory.glob("rank*.json"):
        try:
            rec = json.loads(p.read_text())
            out[int(rec["rank"])] = {
                **rec,
                "step": int(rec["step"]),
                "time": float(rec["time"]),
                "alive": float(rec["alive"]),
            }
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _exit_requeue() -> None:
    from dskit.train.entry import record_exit

    record_exit(EXIT_REQUEUE)
    os._exit(EXIT_REQUEUE)
