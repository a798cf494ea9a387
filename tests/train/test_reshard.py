"""A run resumes on another number of ranks or another EP size, its optimizer state kept (the real
trainer, gloo ranks, ZeRO-3 + AutoEP: dskit/train/checkpoints/reshard.py).

The reference is one uninterrupted 2-rank run at EP 2. Its step-4 checkpoint resumed by 1 rank (EP 1)
must continue that run's loss curve, and the 1-rank run's step-8 checkpoint, resumed by 2 ranks again,
must go on continuing it: 2 -> 1 -> 2 ranks. The same batch is cut into other micro-steps and reduced
in another order, so the curves agree to a tolerance, not bit for bit; a fresh start instead of the
resume would miss it by far (the Adam moments and the learned weights are what carry the curve).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dskit.plan.schema import load_plan
from dskit.train.checkpoints.reshard import UNIVERSAL_DIR
from tests.conftest import RESHARD_RTOL, render_tiny
from tests.train.test_train import losses, run

pytestmark = pytest.mark.train
STEPS, EVERY = 12, 4


def _render(tmp: Path, ranks: int, steps: int, extra: list[str] | None = None, name: str = "run") -> Path:
    sets = [f"checkpoint.every={EVERY}", "checkpoint.keep=100", *(extra or [])]
    return render_tiny(tmp, "tiny-v2", steps=steps, gpus_per_node=ranks, extra=sets, name=name)


def _ckpt(rd: Path) -> Path:
    return Path(load_plan(rd / "run.yaml").run.checkpoint_dir)


def _resume_from(src: Path, tag: str, tmp: Path, ranks: int, steps: int, extra=None, name="run") -> Path:
    """A run dir whose checkpoint dir holds a copy of `src`'s checkpoint `tag` alone."""
    rd = _render(tmp, ranks, steps, extra, name=name)
    _ckpt(rd).mkdir(parents=True)
    shutil.copytree(_ckpt(src) / tag, _ckpt(rd) / tag)
    return rd


def _assert_continues(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=RESHARD_RTOL), (s, got[s], want[s])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("base")
    rd = _render(tmp, 2, STEPS)
    assert load_plan(rd / "run.yaml").parallel.ep_size == 2
    assert run(rd, tmp / "train.log") == 0, (tmp / "train.log").read_text()[-4000:]
    return rd


@pytest.fixture(scope="module")
def one_rank(base, tmp_path_factory) -> Path:
    """Step 4 of the 2-rank run, resumed by 1 rank to the end (the same steps: the same LR schedule)."""
    tmp = tmp_path_factory.mktemp("one")
    rd = _resume_from(base, "step00000004", tmp, 1, STEPS)
    assert load_plan(rd / "run.yaml").parallel.ep_size == 1
    assert run(rd, tmp / "train.log") == 0, (tmp / "train.log").read_text()[-4000:]
    return rd


def test_two_ranks_checkpoint_resumes_on_one_and_continues_the_curve(base, one_rank):
    log = (one_rank.parent / "train.log").read_text()
    assert "resharding step00000004: world size 2 -> 1, ep size 2 -> 1" in log, log[-3000:]
    assert "resumed from" in log and "(step 4)" in log
    got, want = losses(one_rank), losses(base)
    assert sorted(got) == list(range(5, STEPS + 1))  # nothing re-trained, nothing skipped
    _assert_continues(got, want, range(5, STEPS + 1))
    # the universal copy served its purpose once the run saved a checkpoint of its own layout
    assert not (_ckpt(one_rank) / UNIVERSAL_DIR).exists()


def test_and_back_on_two_ranks_it_still_continues_the_curve(base, one_rank, tmp_path):
    rd = _resume_from(one_rank, "step00000008", tmp_path, 2, STEPS)
    log = tmp_path / "train.log"
    assert run(rd, log) == 0, log.read_text()[-4000:]
    assert "resharding step00000008: world size 1 -> 2, ep size 1 -> 2" in log.read_text()
    got = losses(rd)
    assert sorted(got) == list(range(9, STEPS + 1))
    _assert_continues(got, losses(base), range(9, STEPS + 1))


def test_another_ep_size_on_the_same_ranks_resumes(base, tmp_path):
    rd = _resume_from(base, "step00000004", tmp_path, 2, STEPS, extra=["overrides.ep_size=1"])
    log = tmp_path / "train.log"
    assert run(rd, log) == 0, log.read_text()[-4000:]
    assert "resharding step00000004: ep size 2 -> 1;" in log.read_text()
    _assert_continues(losses(rd), losses(base), range(5, STEPS + 1))


def test_a_failed_conversion_is_one_line_and_exit_2_and_the_checkpoint_is_kept(base, tmp_path):
    """A checkpoint whose files verify but that DeepSpeed's converter cannot read (here: the optimizer
    states of rank 1 replaced by an empty pickle, manifest updated to match), resumed by 2 ranks at
    another EP size: rank 0 converts and fails, rank 1 waits and reads why."""
    import json

    import torch

    from dskit.formats.checkpoint_layout import crc

    rd = _resume_from(base, "step00000004", tmp_path, 2, STEPS, extra=["overrides.ep_size=1"])
    tag = _ckpt(rd) / "step00000004"
    (opt,) = tag.glob("*zero_pp_rank_1_*optim_states.pt")
    torch.save({}, opt)
    manifest = tag / "dskit-manifest-rank1.json"
    m = json.loads(manifest.read_text())
    m[opt.name] = [opt.stat().st_size, crc(opt)]
    manifest.write_text(json.dumps(m))
    before = sorted(p.name for p in tag.iterdir())
    log = tmp_path / "train.log"
    assert run(rd, log) == 2, log.read_text()[-4000:]
    errors = [
        ln for ln in log.read_text().splitlines() if ln.startswith("dskit: error: hardware: checkpoint")
    ]
    want = "could not be converted for ep size 2 -> 1 (DeepSpeed's ds_to_universal: KeyError"
    assert len(errors) == 2 and all(want in e for e in errors), errors  # rank 0's; rank 1's from the marker
    assert sorted(p.name for p in tag.iterdir()) == before  # the source is untouched
    # nothing half-made stays: the converter's log, and the marker the next start clears
    left = {p.name for p in (_ckpt(rd) / UNIVERSAL_DIR).iterdir()}
    assert left == {"convert-step00000004.log", "step00000004.failed"}, left
    assert not losses(rd)


def test_another_global_batch_continues_the_data_at_the_next_unseen_sample(base, tmp_path):
    """A resume at another global batch (the default rounds it to the world size) takes the data up
    at the samples the checkpoint consumed, then this run's batch per step."""
    rd = _resume_from(base, "step00000004", tmp_path, 1, STEPS, extra=["training.global_batch=4"])
    log = tmp_path / "train.log"
    assert run(rd, log) == 0, log.read_text()[-4000:]
    was = load_plan(base / "run.yaml").parallel.global_batch
    assert (
        f"the checkpoint of step 4 was written at {4 * was} samples (a global batch of {was}); this run's "
        f"batch is 4: the data continues from sample {4 * was}, none skipped or repeated" in log.read_text()
    )
    assert sorted(losses(rd)) == list(range(5, STEPS + 1))
    for step in (8, STEPS):
        done = json.loads((_ckpt(rd) / f"step{step:08d}" / "dskit.json").read_text())
        assert done["meta"]["samples"] == 4 * was + (step - 4) * 4, done


def test_the_data_position_is_step_times_batch_until_a_resume_moves_it():
    from dskit.data.sampler import DataPosition, sample_index

    layout = {"grad_accum": 2, "world": 2, "micro_batch": 2}
    fresh = DataPosition(0, 0, 8)
    every = [(s, m, r) for s in range(3) for m in range(2) for r in range(2)]
    assert [fresh.micro_batch_start(s, m, r, **layout) for s, m, r in every] == [
        sample_index(s, m, r, **layout) for s, m, r in every
    ]
    moved = DataPosition(4, 32, 4)
    assert [moved.first(s) for s in (4, 5, 6)] == [32, 36, 40]
    assert moved.micro_batch_start(5, 1, 1, grad_accum=2, world=2, micro_batch=1) == 36 + 3


def test_a_lora_runs_checkpoint_of_another_world_size_is_refused_in_one_line(tmp_path):
    """A LoRA run's optimizer files are dskit's own, cut by rank (adapter_state.py): no universal copy."""
    import json

    rd = render_tiny(tmp_path, "tiny-v2", steps=4, gpus_per_node=1, extra=["finetune.method=lora"])
    tag = _ckpt(rd) / "step00000002"
    tag.mkdir(parents=True)
    layout = {"zero_stage": load_plan(rd / "run.yaml").parallel.zero_stage, "ep_size": 2, "finetune": "lora"}
    (tag / "dskit.json").write_text(
        json.dumps({"step": 2, "world_size": 2, "layout": layout, "meta": {"step": 2}})
    )
    log = tmp_path / "train.log"
    assert run(rd, log) == 2, log.read_text()[-4000:]
    (line,) = [ln for ln in log.read_text().splitlines() if ln.startswith("dskit: error:")]
    assert line == (
        f"dskit: error: hardware: checkpoint {tag} was written by world size 2, this run has world size 1, "
        "and a LoRA run's checkpoints do not reshard: render the run with the world size of the checkpoint "
        "(hardware.nodes x hardware.gpus_per_node), or point storage.checkpoint_dir at an empty dir to start fresh"
    )
    assert not (_ckpt(rd) / UNIVERSAL_DIR).exists()


def test_no_room_for_the_universal_copy_stops_with_74_and_the_checkpoint_intact(base, tmp_path, small_disk):
    from dskit.formats.checkpoint_layout import tag_problem
    from dskit.launch.contract import EXIT_DISK_FULL

    src = _ckpt(base) / "step00000004"
    size = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
    disk = small_disk(int(size * 1.5))  # the tag fits, its conversion (about twice as much) does not
    rd = _render(tmp_path, 1, STEPS, extra=[f"storage.checkpoint_dir={disk}/ckpt"])
    shutil.copytree(src, disk / "ckpt" / src.name)
    log = tmp_path / "train.log"
    assert run(rd, log) == EXIT_DISK_FULL, log.read_text()[-4000:]
    errors = [
        ln for ln in log.read_text().splitlines() if ln.startswith("dskit: error: storage.checkpoint_dir:")
    ]
    want = f"{disk}/ckpt/{UNIVERSAL_DIR} is full: the universal copy of step00000004 (for resharding) needs about "
    assert errors and want in errors[0], errors
    assert "the checkpoint step00000004 is intact" in errors[0]
    assert tag_problem(disk / "ckpt" / src.name) is None and not losses(rd)
    assert not (disk / "ckpt" / UNIVERSAL_DIR / "tmp").exists()
