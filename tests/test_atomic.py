"""dskit.io.atomic: the destination always names a whole directory, leftovers of killed builds go away."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dskit.io import atomic, owner
from dskit.io.atomic import MARKER, atomic_dir
from tests.conftest import REPO
from tests.support.cli import cli


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


def _leftover(parent: Path, name: str, pid: int, **identity: object) -> Path:
    """A build dir as a killed build leaves it; without `identity`, as dskit before boot ids wrote it."""
    d = parent / name
    d.mkdir()
    info = {"written_by": "dskit", "host": socket.gethostname(), **identity, "pid": pid}
    (d / MARKER).write_text(json.dumps(info))
    return d


def test_a_killed_builds_leftover_is_removed_by_the_next_run(tmp_path):  # markers before boot ids
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
        "import os, signal; from dskit.io.atomic import atomic_dir\n"
        f"with atomic_dir({str(out)!r}, kind='data') as tmp:\n"
        "    (tmp / 'half').write_text('x'); os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == -9 and not out.exists()
    assert [p.name.startswith(".out.dskit-tmp-") for p in tmp_path.iterdir()] == [True]
    _build(out, "whole")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


LINUX_BOOT_ID = pytest.mark.skipif(not os.path.exists(owner.BOOT_ID), reason="needs Linux's boot id")
TINY_RENDER = ["render", "slurm", "--gpu", "cpu", "--gpus-per-node", "2", "--model", "tiny-v2", "--set"]
TINY_RENDER += ["training.seq_len=128"]
#: a CLI run as in a container sharing this kernel (`docker run -v ...`: its own host name and pid
#: namespace) that SIGKILLs itself right after the first rendered file is written into the build dir
KILLED_IN_A_CONTAINER = """
import os, pathlib, signal, socket, sys
socket.gethostname = lambda: "another-container"
write = pathlib.Path.write_text
def killed_after(self, *a, **k):
    n = write(self, *a, **k)
    if ".dskit-tmp-" in str(self.parent):
        os.kill(os.getpid(), signal.SIGKILL)
    return n
pathlib.Path.write_text = killed_after
from dskit.cli import main
sys.exit(main(sys.argv[1:]))
"""


@LINUX_BOOT_ID
def test_a_render_killed_mid_write_in_a_container_is_cleaned_up_by_the_next_render(tmp_path):
    """Its marker names another host and a pid of another namespace: the old host-and-pid rule kept the
    leftover for good. The lock it held died with it, so the next render removes it."""
    out = tmp_path / "out"
    args = [*TINY_RENDER, "-o", str(out)]
    r = subprocess.run([sys.executable, "-c", KILLED_IN_A_CONTAINER, *args], capture_output=True)
    assert r.returncode == -9, r.stderr
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".out.dskit-tmp-") and len(list(left.iterdir())) == 2  # marker, one file
    assert json.loads((left / MARKER).read_text())["host"] == "another-container"
    cli(*args, check=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    fresh = tmp_path / "fresh"
    cli(*TINY_RENDER, "-o", str(fresh), check=True)
    for f in fresh.rglob("*"):
        if f.is_file() and f.name != MARKER:
            got = (out / f.relative_to(fresh)).read_text()
            assert got == f.read_text().replace(str(fresh), str(out)), f.name


HOLD_OPEN = """
import socket, sys
socket.gethostname = lambda: "another-container"
from dskit.io.atomic import atomic_dir
with atomic_dir(sys.argv[1], kind="data") as tmp:
    (tmp / "half").write_text("x")
    print("building", flush=True)
    sys.stdin.readline()
"""


@LINUX_BOOT_ID
def test_a_live_builders_directory_is_kept_and_removed_once_it_is_killed(tmp_path):
    out = tmp_path / "out"
    builder = subprocess.Popen(
        [sys.executable, "-c", HOLD_OPEN, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert builder.stdout.readline() == "building\n"
        (live,) = tmp_path.iterdir()
        _build(out, "mine")  # runs while the other build is in progress: must not touch it
        assert live.is_dir() and (live / "half").is_file() and (out / "f").read_text() == "mine"
    finally:
        builder.kill()
        builder.wait()
    _build(out, "again", force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def _this_kernel() -> dict:
    """What a marker written here now records, but the pid."""
    return {k: v for k, v in owner.identity().items() if k != "pid"}


@LINUX_BOOT_ID
def test_a_dead_builds_leftover_goes_even_when_its_pid_was_reused(tmp_path):
    """Its marker's pid is a live process (ours here), but nobody holds its lock."""
    reused = _leftover(tmp_path, ".out.dskit-tmp-abc", os.getpid(), **_this_kernel())
    _build(tmp_path / "out", "x")
    assert not reused.exists()


@LINUX_BOOT_ID
def test_another_kernels_leftover_goes_only_if_it_is_this_machine_before_a_reboot(tmp_path):
    me = _this_kernel()
    if me["machine"] is None:
        pytest.skip("no /etc/machine-id")
    dead = {**me, "boot_id": "0" * 32}  # this machine and host name, an earlier boot
    rebooted = _leftover(tmp_path, ".out.dskit-tmp-a", 1, **dead)  # pid 1 runs now, but not that one
    twin = _leftover(tmp_path, ".out.dskit-tmp-b", 1, **{**dead, "machine": "another machine"})
    renamed = _leftover(tmp_path, ".out.dskit-tmp-c", 1, **{**dead, "host": "another-host"})
    _build(tmp_path / "out", "x")
    assert not rebooted.exists() and twin.is_dir() and renamed.is_dir()


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
