"""Faults survived by the real trainer (2 gloo ranks, ZeRO-3 + AutoEP, `dskit train --local`): a hung
rank, damaged checkpoints, a full disk. Each test injects the fault for real (SIGSTOP, bytes cut off
or flipped, a tmpfs too small) and checks what the user is promised: the exit code the launchers act
on, one line saying why, and the last complete checkpoint kept and resumed from.

Waits derive from the module's base run: its slowest step (a checkpoint save included) on this
machine, whatever its load.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dskit.errors import EXIT_BAD_INPUT
from dskit.formats.checkpoint_layout import DONE, complete_tags, newest_verified_tag, tag_for, tag_problem
from dskit.launch.contract import EXIT_DISK_FULL, EXIT_REQUEUE
from dskit.plan.schema import load_plan
from dskit.train.checkpoints.store import prune
from dskit.train.watchdog import REPORT_FILE
from tests.conftest import render_tiny
from tests.train.test_train import assert_same_run, losses, ranks_of, records, run, start, wait_for_step

pytestmark = pytest.mark.train
STEPS, EVERY = 24, 4
#: torchrun's own wait between SIGTERM and SIGKILL for a worker that does not exit (a stopped one)
TORCHRUN_KILL_GRACE_S = 30


def ckpt_dir(rd: Path) -> Path:
    return Path(load_plan(rd / "run.yaml").run.checkpoint_dir)


def out_dir(rd: Path) -> Path:
    return Path(load_plan(rd / "run.yaml").run.output_dir)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """One uninterrupted run with a checkpoint every EVERY steps, all kept; its slowest step sets the
    scale of every wait below."""
    tmp = tmp_path_factory.mktemp("base")
    rd = render_tiny(tmp, steps=STEPS, extra=[f"checkpoint.every={EVERY}", "checkpoint.keep=100"])
    assert run(rd, tmp / "train.log") == 0, (tmp / "train.log").read_text()[-4000:]
    times = [r["time"] for r in records(rd)]
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    return {"run": rd, "losses": losses(rd), "gap": gap, "ckpt_bytes": _bytes(ckpt_dir(rd) / tag_for(EVERY))}


def _bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def _same_plan(base: dict, tmp: Path, extra: list[str] | None = None) -> Path:
    """A run of the base run's plan under other storage, holding a copy of its checkpoints."""
    rd = render_tiny(
        tmp, steps=STEPS, extra=[f"checkpoint.every={EVERY}", "checkpoint.keep=100", *(extra or [])]
    )
    shutil.copytree(ckpt_dir(base["run"]), ckpt_dir(rd))
    return rd


# --------------------------------------------------------------------------- a hung rank


def test_a_stopped_rank_ends_the_run_with_75_within_the_timeout_and_the_next_start_resumes(base, tmp_path):
    """SIGSTOP one rank: the other rank's watchdog names it, dumps its own stacks and exits 75; torchrun
    kills the stopped rank; `--local` relays 75, and the same command resumes from the last checkpoint."""
    timeout = max(15.0, round(10 * base["gap"]))
    rd = render_tiny(
        tmp_path, steps=STEPS, extra=[f"checkpoint.every={EVERY}", f"watchdog.timeout_s={timeout}"]
    )
    p = start(rd, tmp_path / "a.log")
    try:
        wait_for_step(rd, p, EVERY + 2)
        rank1 = ranks_of(p)[1]
        rank1.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        rc = p.wait(timeout=timeout + TORCHRUN_KILL_GRACE_S + 60 * base["gap"] + 60)
        took = time.time() - stopped_at
    finally:
        if p.poll() is None:  # never leave a stopped rank behind a failed wait
            for k in ranks_of(p):
                k.kill()
        p.kill()
    log = (tmp_path / "a.log").read_text()
    assert rc == EXIT_REQUEUE, log[-4000:]
    line = next(x for x in log.splitlines() if x.startswith("dskit: watchdog: rank 0 made no progress"))
    assert f"(timeout {timeout:g} s)" in line and "not responding: rank 1 on " in line, line
    assert line.endswith(f"exiting {EXIT_REQUEUE} to restart from the last checkpoint"), line
    assert "dskit: watchdog: rank 0's stacks:" in log and 'File "' in log  # where rank 0 waited
    assert (out_dir(rd) / REPORT_FILE.format(rank=0)).read_text().startswith(line)
    assert "Traceback" not in log  # torchrun's own page of stack is one line per rank (dskit.launch.torchrun)
    assert "dskit: rank 1 (pid " in log and ") killed by SIGKILL" in log
    # the hang cost the timeout and torchrun's kill, not more
    assert took <= timeout + TORCHRUN_KILL_GRACE_S + 20 * base["gap"] + 15, took
    last = max(losses(rd))

    assert run(rd, tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()[-3000:]
    resumed = int((tmp_path / "b.log").read_text().split("resumed from ")[1].split("(step ")[1].split(")")[0])
    assert last - resumed <= EVERY  # at most one checkpoint interval of work lost
    assert sorted(losses(rd)) == list(range(1, STEPS + 1))
    assert_same_run(losses(rd), base["losses"], exact_until=resumed)


# --------------------------------------------------------------------------- damaged checkpoints


def test_each_damaged_checkpoint_is_skipped_with_one_warning_and_the_previous_one_resumed(base, tmp_path):
    """Four damages at once, newest first: a save killed mid-way (kill -9: a tmp- dir, no dskit.json), a
    corrupt dskit.json, a truncated shard, a missing file. Resume passes over each with one warning
    naming it and continues from the checkpoint before them, reproducing the uninterrupted run."""
    rd = _same_plan(base, tmp_path)
    root = ckpt_dir(rd)
    # kill -9 during the save of step 24: DeepSpeed's files half written, dskit.json never written
    killed = root / f"tmp-{tag_for(24)}"
    (root / tag_for(24)).rename(killed)
    (killed / DONE).unlink()
    shard = next(killed.glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    (root / tag_for(20) / DONE).write_text('{"step": 20, "world_si')  # cut off mid-write
    cut = next((root / tag_for(16)).glob("bf16_zero_pp_rank_1_*optim_states.pt"))
    size = cut.stat().st_size
    with cut.open("r+b") as f:
        f.truncate(size // 2)
    (root / tag_for(12) / "dskit-rng-rank1.pt").unlink()

    assert run(rd, tmp_path / "resume.log") == 0, (tmp_path / "resume.log").read_text()[-4000:]
    log = (tmp_path / "resume.log").read_text()
    warnings = [x for x in log.splitlines() if "cannot be trusted" in x]
    assert len(warnings) == 3, warnings
    assert f"{tag_for(20)} cannot be trusted: {DONE} unreadable (not JSON)" in warnings[0]
    assert (
        f"{tag_for(16)} cannot be trusted: rank 1: {cut.name} truncated ({size // 2} of {size} bytes)"
        in warnings[1]
    )
    assert f"{tag_for(12)} cannot be trusted: rank 1: dskit-rng-rank1.pt missing" in warnings[2]
    assert all(w.endswith("falling back to the previous complete one") for w in warnings)
    assert f"resumed from {root / tag_for(8)} (step 8)" in log
    # set aside, so retention cannot keep them in place of the checkpoints this run writes
    assert "moved 3 untrusted checkpoint(s) aside" in log
    assert sorted(p.name for p in root.glob("untrusted-*")) == [
        f"untrusted-{tag_for(s)}" for s in (12, 16, 20)
    ]
    assert not killed.exists()  # a save in progress is never loaded, and removed at the next start
    assert "Traceback" not in log
    got = losses(rd)  # this run's own records: steps 9.. only, each the uninterrupted run's loss
    assert sorted(got) == list(range(9, STEPS + 1))
    assert_same_run(got, {s: base["losses"][s] for s in got}, exact_until=STEPS)
    assert newest_verified_tag(root).name == tag_for(STEPS)


def test_when_no_checkpoint_can_be_trusted_the_run_says_so_in_one_line_and_exits_2(base, tmp_path):
    rd = _same_plan(base, tmp_path)
    root = ckpt_dir(rd)
    for tag in complete_tags(root):
        victim = next((root / tag).glob("*model_states.pt"))
        victim.write_bytes(victim.read_bytes()[:-1])  # one byte short
    r = subprocess.run(
        [*_dskit_cmd(), "train", "--local", str(rd)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == EXIT_BAD_INPUT, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("dskit: error:")]
    assert errors and all(e == errors[0] for e in errors), r.stderr[-3000:]  # the same line from each rank
    assert errors[0].startswith(f"dskit: error: checkpoint: no checkpoint under {root} can be trusted (")
    assert "Traceback" not in r.stderr
    assert len(complete_tags(root)) == STEPS // EVERY  # nothing deleted: they are the user's to inspect


def _dskit_cmd() -> list[str]:
    import sys

    return [sys.executable, "-m", "dskit"]


def test_retention_counts_only_intact_checkpoints(base, tmp_path):
    """keep=2 with the newest damaged: the two newest intact ones stay, whatever else is there."""
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt_dir(base["run"]), root)
    victim = next((root / tag_for(24)).glob("*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:100])
    prune(root, keep=2)
    assert complete_tags(root) == [tag_for(20), tag_for(16)]
    assert all(tag_problem(root / t) is None for t in complete_tags(root))


# --------------------------------------------------------------------------- a full disk


@pytest.mark.parametrize("room", ["one checkpoint", "half a checkpoint"])
def test_a_full_disk_stops_with_74_keeps_the_previous_checkpoint_and_leaves_no_partial_files(
    base, tmp_path, small_disk, room
):
    """Room for one checkpoint: the second save is refused before it writes (a checkpoint is as big
    as the one before it; the old one stays until the new one is whole). Room for half of one: the
    first save fails while it writes and removes what it wrote."""
    size = base["ckpt_bytes"]
    disk = small_disk(int(size * 1.6) if room == "one checkpoint" else size // 2)
    rd = render_tiny(
        tmp_path, steps=STEPS, extra=[f"checkpoint.every={EVERY}", f"storage.checkpoint_dir={disk}/ckpt"]
    )
    r = subprocess.run(
        [*_dskit_cmd(), "train", "--local", str(rd)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == EXIT_DISK_FULL, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("dskit: error: storage.checkpoint_dir:")]
    assert errors, r.stderr[-3000:]
    assert f"{disk}/ckpt is full: a checkpoint needs " in errors[0], errors[0]
    assert "Free space or point storage.checkpoint_dir at a bigger disk, then resubmit" in errors[0]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    root = disk / "ckpt"
    assert not list(root.glob("tmp-*"))  # its own partial files removed
    if room == "one checkpoint":
        assert f"the previous checkpoint {tag_for(EVERY)} is intact" in errors[0]
        assert f"about {size / 2**30:.2f} GiB" in errors[0]
        assert complete_tags(root) == [tag_for(EVERY)] and tag_problem(root / tag_for(EVERY)) is None
        assert max(losses(rd)) == 2 * EVERY  # stopped at the save, not before
    else:
        assert "no earlier checkpoint exists" in errors[0]
        assert complete_tags(root) == []
