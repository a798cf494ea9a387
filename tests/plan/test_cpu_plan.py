"""CPU ranks (the cpu profile) get a step time like any GPU's (dskit/plan/speed.py "CPU ranks"), from what
`dskit calibrate` measured on them: without a calibration there is no compute rate and the plan keeps
the fit order, with one it weighs every EP size and ZeRO stage. The constants are the fit of the
committed runs (bench/cpu_fit.py; bench/results/cpu/cpu-fit-2026-12-05b.json), which also holds the
calibration those runs were predicted with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cpu_fit
from dskit.plan import speed
from dskit.plan.build import build_plan_searched
from dskit.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
FIT = REPO / "bench" / "results" / "cpu" / "cpu-fit-2026-12-05b.json"
SETS = ["training.seq_len=128", "training.global_batch=8"]
HW = {"hardware.gpu": "cpu", "hardware.gpus_per_node": 2, "model.preset": "tiny-v2-experts"}


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("cal") / "calibration.json"
    p.write_text(json.dumps(json.loads(FIT.read_text())["calibration"]))
    return p


def _plan(*sets: str):
    return build_plan_searched(load_spec(None, [*SETS, *sets], HW))


def test_the_cpu_constants_are_the_fit_of_the_committed_runs():
    """`--check` refits the committed runs: speed.py's constants are the fit (at their rounding) and
    every run is predicted within the script's tolerance (15%)."""
    fitted, rows, off = cpu_fit.compare(cpu_fit.committed_runs(FIT))
    assert fitted and rows and off == [], (off, fitted)


def test_a_cpu_plan_weighs_candidates_only_with_a_measured_compute_rate(calibration_file):
    plan, found = _plan()
    assert plan.speed is None and {(r.candidate.zero_stage, r.candidate.ep_size) for r in found.rows} == {
        (3, 2)
    }
    plan, found = _plan(f"hardware.calibration={calibration_file}")
    assert plan.speed is not None and plan.speed["tokens_per_s_per_gpu"] > 0
    assert {(r.candidate.zero_stage, r.candidate.ep_size) for r in found.rows} == {
        (z, e) for z in (1, 2, 3) for e in (1, 2)
    }
    assert found.chosen.speed.synchronous and found.chosen.speed.bound == "host + device"


def test_a_cpu_ranks_timelines_add():
    """A CPU rank runs its kernels on its own thread: the host's and the device's seconds add."""
    t = speed.StepTime(
        compute_s=1.0, layer_gpu_s=0.0, collectives_s=0.5, grad_copy_s=0.0, all_to_all_s=0.25, host_s=2.0,
        optimizer_s=0.1, tokens_per_step=100, flops_per_token=1.0, peak_tflops=1.0, unknown=(), boundary_s=0.05,
    )  # fmt: skip
    assert t.step_s == pytest.approx(2.0 + 0.1 + 0.05)  # a GPU: the host hides the device's 1.75 s
    cpu = speed.StepTime(**{**t.__dict__, "synchronous": True})
    assert cpu.step_s == pytest.approx(1.75 + 2.0 + 0.1 + 0.05)
