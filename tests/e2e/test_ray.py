"""`dskit render ray` + `ray job submit` on a real local Ray cluster (head on loopback, 2 CPU workers):
the job trains, checkpoints and its workers see the launch contract; a killed worker is replaced by a
restarted worker group that resumes from the last checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from dskit.calibrate import calibration
from dskit.errors import EXIT_BAD_INPUT
from dskit.formats.checkpoint_layout import newest_verified_tag
from dskit.plan import links
from dskit.plan.schema import load_plan
from dskit.status.run_status import read_jobs
from dskit.train.entry import LAUNCH_ENV_FILE
from tests.conftest import dskit, dskit_status, render_tiny
from tests.support.progress_wait import run_while_progressing, wait_while_progressing

pytestmark = pytest.mark.ray
BIN = Path(sys.executable).parent
DASHBOARD = 8265
#: a job whose driver log and run have not changed for this long has hung (waits fail on a stall, not on a
#: clock: tests/support/progress_wait.py); a quiet start prints within about 30 s
START_STALL_S = 300
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")


def ray_temp() -> Path:
    return Path("/tmp") / f"ray-dskit-{os.getpid()}"  # Ray's socket paths must stay short


def activity(run_dir: Path) -> tuple[int, ...]:
    """What the cluster's jobs have done so far, as this machine's files show it: the drivers' logs (Ray
    forwards the workers' output there) and the run's metrics."""
    logs = ray_temp() / "session_latest" / "logs"
    out = Path(load_plan(run_dir / "run.yaml").run.output_dir) / "metrics.jsonl"
    files = [*sorted(logs.glob("job-driver-*.log")), out]
    return tuple(f.stat().st_size if f.exists() else -1 for f in files)


def job_status(job_id: str) -> str:
    """The job's status from the dashboard's REST API (what `ray job status` asks, without starting the
    CLI's interpreter at every poll)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{DASHBOARD}/api/jobs/{job_id}", timeout=60) as r:
        return json.loads(r.read())["status"]


def submit(run_dir: Path, env: dict, *flags: str) -> subprocess.CompletedProcess:
    """The run's submit.sh (blocking: it tails the job to its end), for as long as the job progresses."""
    cmd = ["bash", str(run_dir / "submit.sh"), *flags]
    what = f"submit.sh {' '.join(flags)}".strip()
    return run_while_progressing(cmd, lambda: activity(run_dir), stall_s=START_STALL_S, what=what, env=env)


@pytest.fixture(scope="module")
def ray_cluster():
    if shutil.which("ray", path=f"{BIN}:{os.environ['PATH']}") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the Ray tests: install dskit[ray]")
        pytest.skip("ray is not installed (pip install 'dskit[ray]')")
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        # without it Ray replaces 127.0.0.1 with the machine's external address
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        # Ray starts its workers (the training ranks) at nice 15: beside any other job at normal priority
        # they got a few percent of the CPU, and the module took 1,849 s instead of 190 (docs/targets.md)
        "RAY_worker_niceness": "0",
    }
    temp_dir = ray_temp()
    start = [
        "ray",
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=2",
        "--port=6390",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={DASHBOARD}",
        "--include-dashboard=true",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    r = subprocess.run(start, env=env, capture_output=True, text=True)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        yield env
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


def render(tmp: Path, name: str, steps: int, every: int) -> Path:
    return render_tiny(
        tmp, name=name, steps=steps, target="ray", extra=[f"checkpoint.every={every}", "ray.max_failures=2"]
    )


def metrics(run_dir: Path) -> dict[int, float]:
    f = Path(load_plan(run_dir / "run.yaml").run.output_dir) / "metrics.jsonl"
    out: dict[int, float] = {}
    for line in f.read_text().splitlines() if f.is_file() else []:
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def test_ray_job_submit_trains_and_checkpoints(ray_cluster, tmp_path):
    rd = render(tmp_path, "rayjob", steps=24, every=8)
    r = submit(rd, ray_cluster)
    assert r.returncode == 0 and "succeeded" in r.stdout + r.stderr, (r.stdout + r.stderr)[-4000:]
    ls = metrics(rd)
    assert sorted(ls) == list(range(1, 25)) and sum(ls[s] for s in range(20, 25)) < 0.85 * sum(
        ls[s] for s in range(1, 6)
    )
    plan = load_plan(rd / "run.yaml")
    assert newest_verified_tag(Path(plan.run.checkpoint_dir)).name == "step00000024"
    # the launch contract the Ray workers saw is the plan's (what every target exports)
    seen = json.loads((Path(plan.run.output_dir) / LAUNCH_ENV_FILE).read_text())
    assert {k: seen[k] for k in plan.env} == plan.env
    assert seen["DSKIT_RUN_FILE"].endswith("/run.yaml") and os.path.isabs(seen["DSKIT_RUN_FILE"])
    # submit.sh recorded the submission id and address; `dskit status` asks Ray's job client
    ((job_id, address),) = read_jobs(rd)
    assert address == f"http://127.0.0.1:{DASHBOARD}"
    st = dskit_status(rd, ray_cluster)
    assert st["state"].startswith(f"SUCCEEDED: job {job_id}") and st["attempts"] == "1 submission(s)", st
    assert st["step"].startswith("24 / 24 (complete)") and st["ETA"] == "done", st
    assert st["last checkpoint"].split()[0].endswith("/step00000024"), st


@pytest.mark.timeout(3600)  # a backstop: every wait below fails on a stall first
def test_a_killed_worker_is_replaced_and_training_resumes(ray_cluster, tmp_path):
    """SIGKILL one Ray Train worker mid-run: Ray fails the group, the driver starts a new one (one
    failure of ray.max_failures), and it resumes from the last checkpoint in the plan's checkpoint dir."""
    rd = render(tmp_path, "rayfault", steps=40, every=4)
    address = ["--address", f"http://127.0.0.1:{DASHBOARD}"]
    r = submit(rd, ray_cluster, "--no-wait")
    assert r.returncode == 0, r.stderr
    ((job_id, _),) = read_jobs(rd)
    assert job_id in r.stdout + r.stderr

    def stepped(n: int) -> Callable[[], bool]:
        return lambda: max(metrics(rd), default=0) >= n

    # the first worker group's start-up, measured: the new group after the kill repeats it
    start_s = wait_while_progressing(stepped(1), lambda: activity(rd), stall_s=START_STALL_S, what="step 1")
    wait_while_progressing(stepped(9), lambda: activity(rd), stall_s=START_STALL_S, what="step 9")
    st = dskit_status(rd, ray_cluster)
    assert st["state"].startswith(f"RUNNING: job {job_id}") and int(st["step"].split()[0]) >= 9, st
    assert st["step"].split()[1:3] == ["/", "40,"] and st["ETA"][0].isdigit(), st
    killed_at = max(metrics(rd))
    workers = [
        p for p in psutil.process_iter(["cmdline"]) if "RayTrainWorker" in " ".join(p.info["cmdline"] or [])
    ]
    assert len(workers) == 2, [w.info for w in workers]
    workers[-1].send_signal(signal.SIGKILL)
    wait_while_progressing(
        lambda: job_status(job_id) in ENDED,
        lambda: activity(rd),
        stall_s=max(START_STALL_S, 3 * start_s),
        what="the job's end after the kill",
        poll_s=2,
    )
    status = job_status(job_id)
    logs = subprocess.run(
        ["ray", "job", "logs", *address, job_id], env=ray_cluster, capture_output=True, text=True
    )
    logs = logs.stdout + logs.stderr
    assert status == "SUCCEEDED", (status, logs[-4000:])
    # the driver, not Ray's FailurePolicy, starts the new worker group (dskit/launch/ray_train.py)
    assert "dskit: attempt 1 ended (" in logs and "failure 1, starting a new worker group" in logs, logs[
        -4000:
    ]
    resumed = int(logs.split("resumed from ")[1].split("(step ")[1].split(")")[0])
    assert resumed % 4 == 0 and killed_at - 5 <= resumed <= killed_at  # the last checkpoint before the kill
    assert sorted(metrics(rd)) == list(range(1, 41))
    plan = load_plan(rd / "run.yaml")
    assert newest_verified_tag(Path(plan.run.checkpoint_dir)).name == "step00000040"
    st = dskit_status(rd, ray_cluster)  # the retried worker group shows as a resume in the run's metrics
    assert st["state"].startswith(f"SUCCEEDED: job {job_id}") and st["step"].startswith(
        "40 / 40 (complete)"
    ), st
    assert st["resumed"] == f"1 time(s), at step {resumed + 1}", st


def test_bad_input_in_a_worker_fails_the_job_once_with_its_line(ray_cluster, tmp_path):
    """A SpecError inside the workers (here: the checkpoint to resume was written under another ZeRO
    stage) is exit 2, "do not retry": the job fails at once, not after ray.max_failures attempts, and
    `dskit status` shows the worker's one-line reason."""
    rd = render(tmp_path, "raybad", steps=10, every=5)
    plan = load_plan(rd / "run.yaml")
    other = 1 if plan.parallel.zero_stage != 1 else 2
    tag = Path(plan.run.checkpoint_dir) / "step00000005"
    tag.mkdir(parents=True)
    done = {
        "step": 5,
        "world_size": plan.hardware.world_size,
        "layout": {"zero_stage": other},
        "meta": {"step": 5},
    }
    (tag / "dskit.json").write_text(json.dumps(done))
    r = submit(rd, ray_cluster)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "failed" in out.lower(), out[-4000:]
    ((job_id, _),) = read_jobs(rd)
    logs = subprocess.run(
        ["ray", "job", "logs", "--address", f"http://127.0.0.1:{DASHBOARD}", job_id],
        env=ray_cluster,
        capture_output=True,
        text=True,
    )
    logs = logs.stdout + logs.stderr
    reason = (
        f"overrides.zero_stage: checkpoint {tag} was written with zero stage {other}, this run has "
        f"{plan.parallel.zero_stage}"
    )
    # the driver's own lines (Ray prefixes the workers' and its controller's, and streams them later)
    driver = [ln for ln in logs.strip().splitlines() if not ln.startswith("\x1b[")]
    assert driver[-1].startswith(f"dskit: error: {reason}"), logs[-4000:]
    assert "starting a new worker group" not in logs and "Error count: 1 (max allowed: 0)" in logs
    st = dskit_status(rd, ray_cluster)
    assert st["state"].startswith(f"FAILED: job {job_id}, "), st
    assert "exit code 2" in st["state"] and reason in st["state"], st


def test_ray_refuses_dollar_values_it_would_expand(tmp_path):
    """Ray runs runtime_env values through os.path.expandvars with no escape: refuse, do not alter."""
    r = dskit("render", "ray", "--set", "network.interface=eth$HOME", "-o", str(tmp_path / "o"))
    assert r.returncode == EXIT_BAD_INPUT
    assert r.stderr.strip().splitlines() == [
        "dskit: error: environment NCCL_SOCKET_IFNAME: 'eth$HOME' contains '$', which Ray's runtime_env "
        "expands and cannot escape; remove it from the spec (network.*, storage.*) for the ray target"
    ]
    assert not (tmp_path / "o").exists()


def test_ray_runs_the_calibration_job(ray_cluster, tmp_path):
    """`dskit calibrate ray` + `ray job submit`: the Ray Train workers measure instead of training, and
    rank 0 writes the calibration the plan takes."""
    rd = render_tiny(tmp_path, name="raycal", target="ray", command="calibrate")
    r = submit(rd, ray_cluster)
    assert r.returncode == 0 and "succeeded" in r.stdout + r.stderr, (r.stdout + r.stderr)[-4000:]
    plan = load_plan(rd / "run.yaml")
    cal = calibration.load(
        plan.calibrate.file, field="f", gpu="cpu", fabric=plan.launch.fabric, procs_per_node=2
    )
    assert cal.hardware.procs_per_node == 2 and all("2x1" in cal.collectives[op] for op in links.OPS)
