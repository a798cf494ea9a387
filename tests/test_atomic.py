"""dskit.atomic: the destination always names a whole directory, leftovers of killed builds go away."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from dskit import atomic
from dskit.atomic import MARKER, atomic_dir
from tests.conftest import REPO


def _build(out: Path, text: str, kind: str = "data", **kw) -> None:
    with atomic_dir(out, kind=kind, **kw) as tmp:
        (tmp / "f").write_text(text)


def test_force_swaps_in_place_and_leaves_only_the_new_dir(tmp_path):
    out = tmp_path / "out"
    _build(out, "old")
    assert (out / MARKER).is_file()
    _build(out, "new", force=True)
    assert (out / "f").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_without_renameat2_the_fallback_swap_also_leaves_only_the_new_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    _build(out, "old")
    _build(out, "new", force=True)
    assert (out / "f").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["out"]


def _leftover(parent: Path, name: str, pid: int) -> Path:
    d = parent / name
    d.mkdir()
    info = {"written_by": "dskit", "host": socket.gethostname(), "pid": pid}
    (d / MARKER).write_text(json.dumps(info))
    return d


def test_a_killed_builds_leftover_is_removed_by_the_next_run(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    stale = _leftover(tmp_path, ".out.dskit-tmp-abc", int(dead.stdout))
    running = _leftover(tmp_path, ".out.dskit-tmp-def", os.getpid())  # a build still in progress
    foreign = tmp_path / ".out.dskit-tmp-ghi"  # no marker: not provably ours
    foreign.mkdir()
    _build(tmp_path / "out", "x")
    assert not stale.exists() and running.is_dir() and foreign.is_dir()


def test_kill_9_mid_render_leaves_the_target_absent_and_the_next_render_cleans_up(tmp_path):
    out = tmp_path / "out"
    code = (
        "import os, signal; from dskit.atomic import atomic_dir\n"
        f"with atomic_dir({str(out)!r}, kind='data') as tmp:\n"
        "    (tmp / 'half').write_text('x'); os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == -9 and not out.exists()
    assert [p.name.startswith(".out.dskit-tmp-") for p in tmp_path.iterdir()] == [True]
    _build(out, "whole")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_leftovers_are_matched_literally_not_as_a_glob(tmp_path):
    # `-o '*' --force` must not reach another output's leftovers through glob characters in the name
    other = tmp_path / ".other.dskit-old-abc"
    other.mkdir()
    (other / MARKER).write_text("{}")
    star = tmp_path / "*"
    star.mkdir()
    atomic._clean_stale(star)
    assert (other / MARKER).is_file()
    own = tmp_path / ".*.dskit-old-xyz"
    own.mkdir()
    (own / MARKER).write_text("{}")
    atomic._clean_stale(star)
    assert not own.exists() and other.is_dir()


def test_init_failure_keeps_the_old_file(tmp_path, monkeypatch):
    import tempfile as tf

    from dskit import cli

    old = tmp_path / "s.yaml"
    old.write_text("mine\n")

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tf, "mkstemp", broken)
    assert cli.main(["init", "-o", str(old), "--force"]) == 2
    assert old.read_text() == "mine\n"


def test_force_replaces_only_the_same_kind_of_output(tmp_path):
    """`data prepare -o RUN_DIR --force` must not delete a rendered run (its scripts, jobs, logs)."""
    import pytest

    from dskit.errors import SpecError

    out = tmp_path / "out"
    _build(out, "run", kind="run")
    with pytest.raises(SpecError, match="holds a rendered run directory, not prepared data"):
        _build(out, "data", kind="data", force=True)
    assert (out / "f").read_text() == "run"
    _build(out, "run again", kind="run", force=True)
    assert (out / "f").read_text() == "run again"


def test_force_never_deletes_a_repository(tmp_path):
    import pytest

    from dskit.errors import SpecError

    out = tmp_path / "out"
    _build(out, "old")
    (out / ".git").mkdir()
    with pytest.raises(SpecError, match=r"contains \.git; --force never deletes a repository"):
        _build(out, "new", force=True)
    assert (out / ".git").is_dir() and (out / "f").read_text() == "old"


def test_a_marker_from_before_kinds_is_judged_by_what_the_directory_holds(tmp_path):
    import pytest

    from dskit.errors import SpecError

    out = tmp_path / "out"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"written_by": "dskit", "host": "h", "pid": 1}))
    (out / "run.yaml").write_text("version: 3\n")  # an old rendered run
    with pytest.raises(SpecError, match="holds a rendered run directory, not prepared data"):
        _build(out, "data", kind="data", force=True)
    _build(out, "new run", kind="run", force=True)
    assert (out / "f").read_text() == "new run"
    (out / MARKER).write_text(json.dumps({"written_by": "dskit", "kind": ["odd"]}))
    with pytest.raises(SpecError, match="holds output of unknown kind"):
        _build(out, "x", kind="run", force=True)
