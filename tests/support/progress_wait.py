"""Waits that fail on a stall, not on a clock. On a loaded machine a job's start-up and restarts take
several times as long as on a quiet one; a fixed deadline then fails a run that was still working. These
wait as long as `progress()` keeps changing (a log that grows, a step that lands) and fail after `stall_s`
seconds without a change, naming what they waited for; a test that hangs still ends, by its stall, before
its pytest timeout."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Hashable


def wait_while_progressing(
    done: Callable[[], bool],
    progress: Callable[[], Hashable],
    *,
    stall_s: float,
    what: str,
    poll_s: float = 1.0,
    pause: Callable[[float], object] = time.sleep,
) -> float:
    """Until `done()`; raises TimeoutError after `stall_s` seconds in which `progress()` did not change.
    Between checks, `pause(poll_s)` (one that returns early, once done, saves the rest of the poll).
    Returns the seconds waited."""
    start = last = time.monotonic()
    seen = progress()
    while not done():
        now, state = time.monotonic(), progress()
        if state != seen:
            seen, last = state, now
        if now - last > stall_s:
            raise TimeoutError(f"{what}: no progress for {now - last:.0f} s (after {now - start:.0f} s)")
        pause(poll_s)
    return time.monotonic() - start


def run_while_progressing(
    cmd: list[str], progress: Callable[[], Hashable], *, stall_s: float, what: str, **popen
) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True), killed and raised as TimeoutError on a stall;
    its own output counts as progress (written to a file, not a pipe it could fill and block on)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        with subprocess.Popen(cmd, stdout=out, stderr=err, text=True, **popen) as proc:

            def state() -> Hashable:
                return progress(), os.fstat(out.fileno()).st_size, os.fstat(err.fileno()).st_size

            def pause(s: float) -> None:  # back as soon as the command ends, not at the next poll
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=s)

            try:
                wait_while_progressing(
                    lambda: proc.poll() is not None, state, stall_s=stall_s, what=what, pause=pause
                )
            except TimeoutError as e:
                proc.kill()
                proc.wait()
                out.seek(0)
                err.seek(0)
                raise TimeoutError(f"{e}; its output ends:\n{(out.read() + err.read())[-3000:]}") from None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
