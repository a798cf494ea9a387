"""Optimizer offload trains like ZeRO-3 resident, on the real trainer (2 gloo ranks, EP 2).

The V2 and V3 cluster picks offload the optimizer states to DeepSpeed's CPU Adam (its C++ extension,
built on first use). The offloaded run starts from the same weights as the resident one: the first
loss must be its, and the curve stays on it. It checkpoints, is stopped by SIGTERM, resumes on the
uninterrupted curve and exports a verified model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dskit.plan.schema import load_plan
from tests.conftest import dskit, render_tiny
from tests.train.test_train import assert_same_run, losses, run, stop_with_sigterm
from tests.train.test_zero_stages import STEPS, zero3_reference

pytestmark = pytest.mark.train
#: bf16 on CPU: the host's and torch's Adam round differently (measured drift here: < 1e-3)
CURVE_RTOL = 2e-2


def _render(tmp: Path) -> Path:
    """test_zero_stages' ZeRO-3 run with its optimizer offloaded."""
    extra = ["overrides.zero_stage=3", "checkpoint.every=10", "overrides.offload_optimizer=cpu"]
    return render_tiny(tmp, "tiny-v2", steps=STEPS, extra=extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The offloaded run, and the resident one it follows: test_zero_stages' ZeRO-3 reference."""
    tmp = tmp_path_factory.mktemp("offload")
    rd = _render(tmp)
    assert run(rd, tmp / "train.log", timeout=900) == 0, (tmp / "train.log").read_text()[-4000:]
    return {"resident": zero3_reference(tmp_path_factory), "offload": rd}


def test_the_deepspeed_config_offloads_to_pinned_host_memory(runs):
    zero = {how: load_plan(rd / "run.yaml").deepspeed["zero_optimization"] for how, rd in runs.items()}
    assert "offload_optimizer" not in zero["resident"]
    assert zero["offload"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_first_loss_is_the_resident_runs_and_the_curve_stays_on_it(runs):
    got, want = losses(runs["offload"]), losses(runs["resident"])
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[1] == pytest.approx(want[1], rel=1e-4)
    drift = max(abs(got[s] - want[s]) / want[s] for s in want)
    assert drift < CURVE_RTOL, drift
    assert got[STEPS] < 0.85 * got[1]


def test_an_offloaded_run_resumes_on_its_curve_and_exports(runs, tmp_path):
    rd = _render(tmp_path)
    stopped = stop_with_sigterm(rd, tmp_path / "a.log", 12)
    assert run(rd, tmp_path / "b.log", timeout=900) == 0, (tmp_path / "b.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "b.log").read_text()
    assert_same_run(losses(rd), losses(runs["offload"]), exact_until=stopped)
    r = dskit("export", str(rd), "-o", str(tmp_path / "hf"), check=True, timeout=900)
    assert "verified: exported logits match the trained model" in r.stdout, r.stdout
