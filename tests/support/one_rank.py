"""A script on a real one-rank DeepSpeed process group (gloo on 127.0.0.1), in a subprocess: a process
group must not outlive the test that made it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.trackers import free_port


def run(script: str, cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -c SCRIPT ARGS` as rank 0 of a world of 1."""
    rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **rank, "MASTER_PORT": str(free_port()), **(env or {})},
        cwd=cwd,
        timeout=600,
    )


def printed(proc: subprocess.CompletedProcess, tag: str) -> str | None:
    """What the script printed after `TAG ` on its own line (None: no such line)."""
    return next((x[len(tag) + 1 :] for x in proc.stdout.splitlines() if x.startswith(tag + " ")), None)


def result(proc: subprocess.CompletedProcess) -> dict:
    """The JSON the script printed after `RESULT `; fails with its output's tail where there is none."""
    line = printed(proc, "RESULT")
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(line)
