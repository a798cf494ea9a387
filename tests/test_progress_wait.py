"""Waits that fail on a stall, not on a clock (tests/support/progress_wait.py): a job that keeps making
progress is waited for however long it takes; one that stops is killed after the stall window, named."""

from __future__ import annotations

import sys
import time

import pytest

from tests.support.progress_wait import run_while_progressing, wait_while_progressing


def test_a_command_that_keeps_printing_outlives_the_stall_window():
    """2.4 s of output, a line every 0.3 s, under a 1.5 s window: its own output is its progress."""
    loop = "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.3)\nprint('done', file=__import__('sys').stderr)"
    start = time.monotonic()
    r = run_while_progressing([sys.executable, "-c", loop], lambda: 0, stall_s=1.5, what="printer")
    assert r.returncode == 0 and r.stdout.split() == [str(i) for i in range(8)] and r.stderr == "done\n"
    assert time.monotonic() - start > 1.5  # it did outlive the window


def test_a_silent_command_is_killed_after_the_window_and_named():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^sleeper: no progress for [0-9]+ s"):
        run_while_progressing(
            [sys.executable, "-c", "import time; time.sleep(60)"], lambda: 0, stall_s=1, what="sleeper"
        )
    assert time.monotonic() - start < 30  # killed, not waited out


def test_output_past_a_pipes_buffer_does_not_block_the_command():
    """A blocking `ray job submit` tails the job's log to its stdout: more than a pipe holds."""
    talk = "import sys, time\nprint('x' * 1_000_000)\nprint(time.time(), file=sys.stderr)"
    r = run_while_progressing([sys.executable, "-c", talk], lambda: 0, stall_s=20, what="talker")
    assert r.returncode == 0 and len(r.stdout) == 1_000_001
    # its end is noticed as it happens, not at the next 1 s poll (the Ray tests run dozens of commands)
    assert time.time() - float(r.stderr) < 0.5


def test_a_change_in_progress_resets_the_window():
    """Done after 1.2 s, with progress every 0.2 s and a 0.6 s window: a clock of 0.6 s would have
    failed it."""
    start = time.monotonic()
    waited = wait_while_progressing(
        lambda: time.monotonic() - start > 1.2,
        lambda: int((time.monotonic() - start) / 0.2),
        stall_s=0.6,
        what="ticker",
        poll_s=0.05,
    )
    assert 1.2 <= waited < 10
    with pytest.raises(TimeoutError, match="^still: no progress"):
        wait_while_progressing(lambda: False, lambda: 0, stall_s=0.5, what="still", poll_s=0.1)
