"""The watchdog itself (dskit/train/watchdog.py), on real threads and real time: it fires after the
timeout and not before, its exit code says whether a restart can help, and its line names a rank whose
heartbeat went silent."""

from __future__ import annotations

import json
import os
import time

from dskit.launch.contract import EXIT_REQUEUE
from dskit.train.watchdog import EXIT_HUNG_AT_START, HEARTBEAT_DIR, REPORT_FILE, Watchdog

TIMEOUT = 0.6


def _fired(dog: Watchdog, within: float) -> list[int]:
    codes: list[int] = []
    dog.on_fire = codes.append
    deadline = time.monotonic() + within
    while not codes and time.monotonic() < deadline:
        time.sleep(0.02)
    return codes


def test_a_rank_that_keeps_beating_is_left_alone(tmp_path):
    with Watchdog(TIMEOUT, str(tmp_path), 0, poll_s=0.05) as dog:
        dog.begin(0)
        codes: list[int] = []
        dog.on_fire = codes.append
        for step in range(1, 30):
            time.sleep(TIMEOUT / 6)
            dog.beat(step)
        assert codes == []


def test_a_hang_after_progress_exits_75_and_before_any_step_exits_1(tmp_path):
    with Watchdog(TIMEOUT, str(tmp_path / "a"), 0, poll_s=0.05) as dog:
        dog.begin(10)
        dog.beat(11)
        t0 = time.monotonic()
        assert _fired(dog, 10 * TIMEOUT) == [EXIT_REQUEUE]
        assert time.monotonic() - t0 >= TIMEOUT * 0.9  # not before the timeout
    with Watchdog(TIMEOUT, str(tmp_path / "b"), 0, poll_s=0.05) as dog:
        dog.begin(10)  # resumed, then hung in its first step: a restart would hang the same way
        assert _fired(dog, 10 * TIMEOUT) == [EXIT_HUNG_AT_START]
    line = (tmp_path / "b" / REPORT_FILE.format(rank=0)).read_text().splitlines()[0]
    assert "no step finished since the start, so a restart would hang the same way" in line


def test_the_line_names_the_rank_whose_heartbeat_went_silent(tmp_path):
    beats = tmp_path / HEARTBEAT_DIR
    beats.mkdir()
    old = time.time() - 120
    (beats / "rank1.json").write_text(
        json.dumps(
            {"rank": 1, "step": 7, "phase": "step", "time": old, "alive": old, "host": "node2", "pid": 4242}
        )
    )
    with Watchdog(TIMEOUT, str(tmp_path), 0, poll_s=0.05) as dog:
        dog.begin(0)
        dog.beat(8)
        assert _fired(dog, 10 * TIMEOUT) == [EXIT_REQUEUE]
    report = (tmp_path / REPORT_FILE.format(rank=0)).read_text()
    line = report.splitlines()[0]
    assert line.startswith("dskit: watchdog: rank 0 made no progress for ")
    assert (
        "not responding: rank 1 on node2 (pid 4242, silent for 12" in line and "after step 7 (step)" in line
    )
    assert 'File "' in report  # its own stacks follow the line
    mine = json.loads((beats / "rank0.json").read_text())
    assert mine["pid"] == os.getpid() and mine["step"] == 8 and time.time() - mine["alive"] < 5
