"""Every ZeRO stage the planner may pick trains like ZeRO-3, on the real trainer (2 gloo ranks, EP 2).

ZeRO-1 and 2 keep the 16-bit weights whole on every rank: a different construction path (no
zero.Init), other DeepSpeed checkpoint files, other collectives. The random init is drawn per module
from (seed, name), so all stages start from the same weights: the first loss must be ZeRO-3's, and the
curve must stay on it. Each stage checkpoints and exports a verified model; ZeRO-2 (the planner's usual
pick of the two) resumes where ZeRO-3 does; a checkpoint written under another stage is refused, and
one written at another world and EP size resumes through its universal copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dskit.plan.schema import load_plan
from tests.conftest import RESHARD_RTOL, dskit, render_tiny
from tests.support.shared import built_once, run_root
from tests.train.test_train import assert_same_run, losses, run, stop_with_sigterm

pytestmark = pytest.mark.train
STEPS = 20
#: bf16 on CPU: stages reduce gradients in different orders and buckets (measured drift here: < 1e-3)
CURVE_RTOL = 2e-2


def _render(tmp: Path, stage: int, **kw) -> Path:
    extra = [f"overrides.zero_stage={stage}", "checkpoint.every=10", *kw.pop("extra", [])]
    return render_tiny(tmp, "tiny-v2", steps=STEPS, extra=extra, **kw)


def _trained(tmp: Path, stage: int, **kw) -> Path:
    rd = _render(tmp, stage, **kw)
    assert load_plan(rd / "run.yaml").deepspeed["zero_optimization"]["stage"] == stage
    assert run(rd, tmp / "train.log") == 0, (tmp / "train.log").read_text()[-4000:]
    return rd


def zero3_reference(factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted ZeRO-3 run, its optimizer resident: the curve the other stages here and
    test_offload's offloaded run must follow, trained once per run for both modules and only read
    (tests/support/shared.py). Its storage lies beside the shared folder, which is renamed when built."""
    storage = run_root(factory) / "shared" / "zero3-reference-storage"

    def build(d: Path) -> None:
        shutil.rmtree(storage, ignore_errors=True)  # a failed build's checkpoints: never resumed from
        _trained(d, 3, extra=["overrides.offload_optimizer=none", f"storage.root={storage}"])

    return built_once(factory, "zero3-reference", build) / "run"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    out = {3: zero3_reference(tmp_path_factory)}
    for stage in (2, 1):
        out[stage] = _trained(tmp_path_factory.mktemp(f"zero{stage}"), stage)
    return out


@pytest.mark.parametrize("stage", [2, 1])
def test_first_loss_is_zero3s_and_the_curve_stays_on_it(runs, stage):
    got, want = losses(runs[stage]), losses(runs[3])
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[1] == pytest.approx(want[1], rel=1e-4)  # the same weights, the same first batch
    drift = max(abs(got[s] - want[s]) / want[s] for s in want)
    assert drift < CURVE_RTOL, drift
    assert got[STEPS] < 0.85 * got[1]


@pytest.mark.parametrize("stage", [2, 1])
def test_export_of_each_stage_is_verified(runs, stage, tmp_path):
    r = dskit("export", str(runs[stage]), "-o", str(tmp_path / "hf"), check=True, timeout=900)
    assert "verified: exported logits match the trained model" in r.stdout, r.stdout


def test_zero2_sigterm_then_resume_continues_the_uninterrupted_run(runs, tmp_path):
    rd = _render(tmp_path, 2)
    stopped = stop_with_sigterm(rd, tmp_path / "a.log", 12)
    assert run(rd, tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "b.log").read_text()
    assert_same_run(losses(rd), losses(runs[2]), exact_until=stopped)


def test_a_checkpoint_of_another_stage_is_refused_with_one_line(runs, tmp_path):
    """The ZeRO-1 run's checkpoints, resumed by the same run rendered for ZeRO-2: exit 2, the setting
    named, nothing trained."""
    ckpt = load_plan(runs[1] / "run.yaml").run.checkpoint_dir
    rd = _render(tmp_path, 2, extra=[f"storage.checkpoint_dir={ckpt}", f"training.steps={STEPS + 5}"])
    log = tmp_path / "train.log"
    assert run(rd, log) == 2, log.read_text()[-3000:]
    text = log.read_text()
    assert "overrides.zero_stage: checkpoint" in text and "written with zero stage 1, this run has 2" in text
    assert not losses(rd)


@pytest.mark.parametrize("stage", [2, 1])
def test_a_checkpoint_resumes_on_one_rank_at_ep_1_on_the_curve(runs, stage, tmp_path):
    """Step 10 of the 2-rank EP-2 run (the fused step's files), resumed by 1 rank at EP 1 through the
    universal copy (dskit/train/checkpoints/reshard.py): the rest of the uninterrupted run's curve."""
    rd = _render(tmp_path, stage, gpus_per_node=1)
    assert load_plan(rd / "run.yaml").parallel.optimizer_step == "fused"
    ckpt = Path(load_plan(rd / "run.yaml").run.checkpoint_dir)
    ckpt.mkdir(parents=True)
    shutil.copytree(
        Path(load_plan(runs[stage] / "run.yaml").run.checkpoint_dir) / "step00000010", ckpt / "step00000010"
    )
    log = tmp_path / "train.log"
    assert run(rd, log) == 0, log.read_text()[-3000:]
    assert "resharding step00000010: world size 2 -> 1, ep size 2 -> 1" in log.read_text()
    got, want = losses(rd), losses(runs[stage])
    assert sorted(got) == list(range(11, STEPS + 1))
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=RESHARD_RTOL), s


def test_the_fused_step_trains_as_deepspeeds_with_the_clip_inside_adam(tmp_path):
    """ZeRO-1/2's default optimizer step (torch's fused AdamW, the clip coefficient handed to its kernel,
    the norm in fp32; dskit/train/fused_step.py) against DeepSpeed's own, with a clip so tight that the
    clipped gradients fall to Adam's eps and the run barely moves: the same curve. Unclipped, the same
    run trains, so a lost clip cannot pass (Adam is otherwise blind to a gradient's scale)."""
    got = {}
    for name, sets in {
        "deepspeed": ["overrides.optimizer_step=deepspeed", "training.grad_clip=1e-5"],
        "fused": ["training.grad_clip=1e-5"],
        "unclipped": ["training.grad_clip=0"],
    }.items():
        rd = render_tiny(tmp_path / name, "tiny-v2", steps=8, extra=["overrides.zero_stage=2", *sets])
        assert load_plan(rd / "run.yaml").parallel.optimizer_step == (
            "deepspeed" if name == "deepspeed" else "fused"
        )
        assert run(rd, tmp_path / f"{name}.log") == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        got[name] = losses(rd)
        # what the trainer says it installed, which benchmarks check against the plan
        built = Path(load_plan(rd / "run.yaml").run.output_dir, "construction-rank0.json")
        assert json.loads(built.read_text())["ran"]["optimizer_step"] == (
            "deepspeed" if name == "deepspeed" else "fused"
        )
    drift = max(abs(got["fused"][s] - got["deepspeed"][s]) / got["deepspeed"][s] for s in got["deepspeed"])
    apart = max(
        abs(got["unclipped"][s] - got["deepspeed"][s]) / got["deepspeed"][s] for s in got["deepspeed"]
    )
    assert got["fused"][1] == got["deepspeed"][1]
    assert drift < 1e-3 and apart > 0.02, (drift, apart)  # measured: 1.4e-5 and 0.044


def test_a_checkpoint_of_the_other_optimizer_step_is_refused_with_one_line(runs, tmp_path):
    """The ZeRO-2 run's checkpoints (the fused step) resumed with DeepSpeed's step: their optimizer states
    differ in kind, so exit 2 names the setting."""
    ckpt = load_plan(runs[2] / "run.yaml").run.checkpoint_dir
    extra = [
        f"storage.checkpoint_dir={ckpt}",
        f"training.steps={STEPS + 5}",
        "overrides.optimizer_step=deepspeed",
    ]
    rd = _render(tmp_path, 2, extra=extra)
    log = tmp_path / "train.log"
    assert run(rd, log) == 2, log.read_text()[-3000:]
    assert "written with optimizer step fused, this run has deepspeed" in log.read_text()
    assert not losses(rd)
