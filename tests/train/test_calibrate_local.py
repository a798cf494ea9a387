"""`dskit calibrate local`: the real calibration job (2 gloo ranks on this machine, started like a
training run) writes a calibration the plan takes, shows its progress, and leaves nothing half-written
when it is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dskit.calibrate import calibration, candidates, scales
from dskit.calibrate.measures import calibration_name
from dskit.plan import links
from tests.conftest import TINY_SETS, dskit
from tests.support.cli import cli

pytestmark = pytest.mark.train


#: the tiny CPU spec both `dskit calibrate` and `dskit plan` take here
SPEC = [
    "--gpu",
    "cpu",
    "--gpus-per-node",
    "2",
    "--model",
    "tiny-v2",
    *(x for s in TINY_SETS for x in ("--set", s)),
]


def _args(tmp: Path, name: str) -> list[str]:
    sets = [f"storage.root={tmp / 'storage'}", f"runtime.python={sys.executable}"]
    return [
        "calibrate",
        "local",
        *SPEC,
        "--runtime",
        "none",
        "--job-name",
        name,
        "-o",
        str(tmp / name),
        *(x for s in sets for x in ("--set", s)),
    ]


def test_calibrate_writes_what_the_plan_reads(tmp_path):
    """With --candidates 2 it then trains the plan's two first candidates for a few steps each and
    records them beside their predictions, in a report of their own beside the calibration."""
    r = dskit(*_args(tmp_path, "cal"), "--candidates", "2", check=True)
    out = tmp_path / "storage" / calibration_name("cal", "local") / "outputs" / "calibration.json"
    steps = [line for line in r.stdout.splitlines() if line.startswith("dskit: calibrate [")]
    assert steps and steps[-1].startswith(f"dskit: calibrate [{len(steps)}/{len(steps)},")
    assert f"calibration: {out}" in r.stdout
    cal = calibration.load(out, field="f", gpu="cpu", fabric="tcp", procs_per_node=2)
    assert cal.hardware.backend == "gloo" and cal.hardware.nodes == 1
    assert set(cal.collectives) == set(links.OPS)
    for op in links.OPS:
        fit = cal.collectives[op]["2x1"]
        assert fit.bus_gbs > 0 and len(fit.points) >= 3
    assert cal.compute.gemm_tflops > 0  # the GEMM probe, run on the CPU
    assert cal.compute.attention_tflops is None  # FlashAttention's probe: a GPU's only
    assert cal.compute.host_layer_pass_s > 0
    assert cal.cpu_adam is not None and cal.cpu_adam.ranks == 2
    assert "candidates" not in json.loads(out.read_text())  # the calibration holds what the plan reads
    report = candidates.Report.model_validate_json((out.parent / "candidates.json").read_text())
    assert report.calibration == str(out) and f"candidates: {out.parent / 'candidates.json'}" in r.stdout
    assert len(report.candidates) == 2 and len({c.candidate for c in report.candidates}) == 2
    for c in report.candidates:
        assert c.measured_tokens_per_s > 0 and c.measured_peak_gib > 0 and c.steps == 8
        assert c.predicted_tokens_per_s > 0  # predicted from this calibration's own probes
        assert c.candidate in r.stdout
    plan = cli("plan", *SPEC, "--calibration", str(out), "--explain", check=True)
    # what this calibration measured, and the step's terms that took it (tests/plan/test_explain.py)
    assert "what the calibration measured (1x2 cpu, cpu, gloo" in plan.stdout, plan.stdout
    host = cal.compute.host_layer_pass_s / scales.reference("cpu").compute.host_layer_pass_s
    assert f"compute: {scales.scaled('cpu')} (x{host:.2f})" in plan.stdout  # by the host probe
    # the run.yaml the job ran: a training run's, plus the calibrate section
    run_yaml = (tmp_path / "cal" / "run.yaml").read_text()
    assert "calibrate:" in run_yaml and str(out) in run_yaml
    # calibrated again without --candidates: the report of the earlier calibration is not left beside it
    dskit(*_args(tmp_path, "cal"), "--force", check=True)
    assert out.is_file() and not (out.parent / "candidates.json").exists()


def test_candidates_are_trained_here_only(tmp_path):
    r = cli("calibrate", "slurm", "--candidates", "2", "-o", str(tmp_path / "x"), "--gpu", "cpu")
    assert r.returncode == 2 and "dskit: error: --candidates: trains here" in r.stderr
    assert not (tmp_path / "x").exists()


def test_a_killed_calibration_leaves_no_file(tmp_path):
    """Killed after it started measuring: no calibration.json, no temporary file beside it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dskit", *_args(tmp_path, "killed")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    try:
        for line in proc.stdout:  # waits on the job's own progress, not on a clock
            seen.append(line)
            if line.startswith("dskit: calibrate [2/"):
                break
        else:
            raise AssertionError("the job ended before measuring:\n" + "".join(seen))
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    outputs = tmp_path / "storage" / calibration_name("killed", "local") / "outputs"
    assert outputs.is_dir()  # where the job measured: an empty listing of the wrong folder would pass
    left = sorted(p.name for p in outputs.glob("*calibration*")) if outputs.exists() else []
    assert left == [], f"after {seen[-1].strip()!r}: {left}"
