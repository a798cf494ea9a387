"""`dskit plan --calibration FILE --explain` (dskit/plan/explain.py) on CPU ranks, as after `dskit
calibrate local`: what the calibration measured, what each term of the step took from it, and where the
chosen step's seconds go. The real `calibrate local` -> `plan --explain` loop runs in
tests/train/test_calibrate_local.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dskit.calibrate import calibration, scales
from tests.conftest import dskit

REPO = Path(__file__).resolve().parents[2]
MACHINE = "the CPU reference machine (2 cores)"
PLAN = ["plan", "--gpu", "cpu", "--gpus-per-node", "2", "--model", "tiny-v2-experts"]
SETS = ["training.seq_len=128", "training.global_batch=8", "overrides.ep_size=2"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Path:
    """The CPU reference calibration (a `dskit calibrate local` of the reference machine) as another
    machine would read: its host twice as slow, its CPU Adam 1.5 times, its GEMM rate 0.6 times."""
    data = json.loads((REPO / "dskit" / "catalog" / "calibration-reference-cpu.json").read_text())
    data["compute"]["host_layer_pass_s"] *= 2
    data["compute"]["gemm_tflops"] *= 0.6
    data["cpu_adam"]["core_s_per_bparam"] *= 1.5
    p = tmp_path_factory.mktemp("cal") / "calibration.json"
    p.write_text(json.dumps(data))
    return p


def test_a_cpu_plan_says_what_was_measured_and_what_each_term_took(measured):
    r = dskit(*PLAN, *(x for s in SETS for x in ("--set", s)), "--calibration", str(measured), "--explain")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    cal, ref = calibration.read(measured), scales.reference("cpu")

    # what was measured: every timed group, each probe, beside the reference machine's reading
    at = lines.index(
        f"what the calibration measured (1x2 cpu, cpu, gloo, torch {cal.hardware.torch}, {cal.created}):"
    )
    block = lines[at + 1 :]
    names = {
        "all_gather": "all-gather",
        "reduce_scatter": "reduce-scatter",
        "autoep_exchange": "AutoEP's exchange",
    }
    for op, name in names.items():
        fit = cal.collectives[op]["2x1"]
        assert any(
            x.startswith(f"  {name} over 2x1 (2 ranks inside a node): {fit.bus_gbs:.3g} GB/s, ")
            for x in block
        ), (name, block)
    gemm, gemm_ref = cal.compute.gemm_tflops * 1e3, ref.compute.gemm_tflops * 1e3
    assert f"  GEMM: {gemm:.3g} GFLOP/s; {MACHINE}: {gemm_ref:.3g} GFLOP/s" in block
    assert "  attention: not measured" in block  # the attention probe is a GPU's
    host, host_ref = cal.compute.host_layer_pass_s * 1e6, ref.compute.host_layer_pass_s * 1e6
    assert f"  host: {host:.3g} us a layer pass; {MACHINE}: {host_ref:.3g} us a layer pass" in block
    adam, adam_ref = cal.cpu_adam.core_s_per_bparam, ref.cpu_adam.core_s_per_bparam
    assert (
        f"  CPU Adam: {adam:.3g} core-s per billion parameters, 2 rank(s) x 1 thread(s) at once; {MACHINE}: "
        f"{adam_ref:.3g} core-s per billion parameters"
    ) in block

    # what each term of the chosen step took: the measured rate, or the fitted constant scaled by the ratio
    sources = lines[lines.index("where each term's rate comes from:") + 1 : at]
    assert f"  compute: fitted on {MACHINE}, scaled by this cluster's probe (x2.00)" in sources  # host
    assert f"  host: fitted on {MACHINE}, scaled by this cluster's probe (x2.00)" in sources
    assert f"  cpu_adam: fitted on {MACHINE}, scaled by this cluster's probe (x1.50)" in sources
    assert f"  attention: fitted on {MACHINE} (dskit/plan/speed.py)" in sources
    groups = [x for x in sources if " group (" in x]
    # at EP 2 of 2 ranks each expert has one replica: no expert-data-parallel group to time
    assert {x.split(" (")[0].strip() for x in groups} == {"dense group", "ep group"}
    assert all("measured on this cluster (dskit calibrate)" in x for x in groups), groups
    # and where the chosen step's seconds go, term by term
    (step,) = [x for x in lines if x.startswith("chosen, where the step goes: compute ")]
    assert "all-to-all" in step and "optimizer" in step and "host + device-bound" in step
