"""What tests of several modules build alike, built once per run and shared by both xdist workers: a
tiny model trained to a fixed state, a checkpoint written in a given format. Built under a file lock in
a folder of this run's temporary root (the workers' common parent), so the second worker to ask waits
for the first one's build instead of repeating it."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def run_root(factory: pytest.TempPathFactory) -> Path:
    """This run's temporary root: under xdist the parent of every worker's base, else the base."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name` that `build(folder)` fills, built by the first test of the run to ask for it.
    A build that fails leaves nothing behind, so the next asker builds it again (and fails the same)."""
    root = run_root(factory) / "shared"
    root.mkdir(exist_ok=True)
    done = root / name
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_dir():
            part = root / f"{name}.part"
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir()
            try:
                build(part)
            except BaseException:
                shutil.rmtree(part, ignore_errors=True)
                raise
            part.rename(done)
    return done
