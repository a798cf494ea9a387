"""The rendered sbatch job on a real 2-node Slurm cluster (tests/support/slurm_cluster.py): training across
nodes, preemption with requeue, a lost node, a chain of time-limited jobs, and `sbatch --test-only`
for every rendered variant.

The jobs run the trainer from this test's own interpreter (`runtime.kind: none`), 1 rank per node,
EP=2, ZeRO-3 on gloo over the nodes' private bridge.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from dskit import catalog
from dskit.formats.checkpoint_layout import newest_verified_tag
from dskit.launch.contract import STOP_FILE
from dskit.plan.build import build_plan
from dskit.plan.schema import load_plan
from dskit.render import slurm
from dskit.spec import load_spec
from dskit.train.entry import LAUNCH_ENV_FILE
from tests.conftest import dskit, dskit_status, render_tiny
from tests.support.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm


def render(
    tmp: Path, name: str, *, steps: int, every: int, extra: list[str] = (), flags: list[str] = ()
) -> Path:
    """2 nodes x 1 rank, gloo over the nodes' eth0 on the test bridge."""
    return render_tiny(
        tmp,
        name=name,
        steps=steps,
        nodes=2,
        gpus_per_node=1,
        flags=flags,
        extra=[f"checkpoint.every={every}", "network.interface=eth0", "slurm.partition=debug", *extra],
    )


def metrics(run_dir: Path) -> list[dict]:
    f = Path(load_plan(run_dir / "run.yaml").run.output_dir) / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.is_file() else []


def wait_step(run_dir: Path, step: int, c: SlurmCluster, job: int, timeout: float = 240) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        done = max((r["step"] for r in metrics(run_dir)), default=0)
        if done >= step:
            return done
        assert c.state(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), c.state(job)
        time.sleep(0.3)
    raise TimeoutError(f"no step {step} in {timeout}s\n{c.logs()}")


def output(tmp: Path, name: str, job: int) -> str:
    return (tmp / f"{name}-{job}.out").read_text()


def test_trains_across_two_nodes(cluster, tmp_path):
    rd = render(tmp_path, "across", steps=30, every=10)
    job = cluster.sbatch(str(rd / "job.sbatch"), cwd=tmp_path)
    st = cluster.wait(job, 300)
    out = output(tmp_path, "across", job)
    assert st["JobState"] == "COMPLETED", out[-3000:]
    assert "rank 0 of 2 on node1" in out and "rank 1 of 2 on node2" in out  # both hosts took part
    plan = load_plan(rd / "run.yaml")
    seen = json.loads((Path(plan.run.output_dir) / LAUNCH_ENV_FILE).read_text())
    assert {k: seen[k] for k in plan.env} == plan.env  # the contract as the ranks saw it
    losses = [r["loss"] for r in metrics(rd)]
    assert len(losses) == 30 and sum(losses[-5:]) < 0.85 * sum(losses[:5])
    assert newest_verified_tag(Path(load_plan(rd / "run.yaml").run.checkpoint_dir)).name == "step00000030"
    # submitted with plain sbatch: job.sbatch recorded its id, so `dskit status` finds it
    st = dskit_status(rd, cluster.env)
    assert st["state"].startswith(f"COMPLETED: job {job}, on node[1-2]"), st
    assert st["attempts"] == "1 job(s), 0 requeue(s)" and st["step"].startswith("30 / 30 (complete)"), st
    assert st["last checkpoint"].split()[0].endswith("/step00000030") and st["ETA"] == "done", st
    assert st["log"] == str(tmp_path / f"across-{job}.out"), st


def test_only_the_runtime_section_differs_from_the_pyxis_render(tmp_path):
    """The script under test comes from the same template as the default (pyxis) job."""
    spec = {
        "hardware.gpu": "cpu",
        "hardware.gpus_per_node": 1,
        "hardware.nodes": 2,
        "model.preset": "tiny-v2",
    }
    texts = {}
    for runtime in ("none", "pyxis"):
        plan = build_plan(
            load_spec(
                sets=["training.seq_len=128", "training.global_batch=8"],
                flags={**spec, "runtime.kind": runtime},
            )
        )
        texts[runtime] = slurm.render(plan, tmp_path)["job.sbatch"].splitlines()
    import difflib

    changed = [
        ln
        for ln in difflib.unified_diff(texts["none"], texts["pyxis"], lineterm="", n=0)
        if ln[:1] in "+-" and not ln.startswith(("+++", "---"))
    ]
    assert changed and all(
        ln[1:].strip().lstrip("'").startswith(("--container-", "--no-container")) for ln in changed
    ), changed


def submit(rd: Path, c: SlurmCluster, cwd: Path) -> list[int]:
    """The rendered submit.sh (what `dskit render` says to run next): the job ids it printed."""
    r = subprocess.run(
        ["bash", str(rd / "submit.sh")], capture_output=True, text=True, env=c.env, cwd=cwd, check=True
    )
    return [int(line.split()[-1]) for line in r.stdout.splitlines()]


def test_preemption_checkpoints_requeues_and_resumes(cluster, tmp_path):
    rd = render(tmp_path, "preempt", steps=60, every=1000)
    r = dskit("status", str(rd), env=cluster.env)
    assert r.returncode == 2 and "not submitted yet" in r.stderr, r.stderr
    (job,) = submit(rd, cluster, tmp_path)
    seen = wait_step(rd, 8, cluster, job)
    st = dskit_status(rd, cluster.env)  # the scheduler's answer and the run's own files agree
    assert st["state"].startswith(f"RUNNING: job {job}, on node[1-2]"), st
    step = int(st["step"].split()[0])
    assert seen <= step <= 60 and st["step"].split()[1:3] == ["/", "60,"], st
    assert st["attempts"] == "1 job(s), 0 requeue(s)" and st["ETA"][0].isdigit(), st
    # what Slurm does before a time limit or a preemption with --signal=B:USR1@grace
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], check=True, env=cluster.env)
    st = cluster.wait(job, 420)
    out = output(tmp_path, "preempt", job)
    assert st["JobState"] == "COMPLETED", out[-3000:]
    assert int(st["Restarts"]) == 1
    assert "USR1 received" in out and f"requeueing job {job}" in out
    stopped = int(out.split("stopped at step ")[1].split()[0])
    rows = metrics(rd)
    assert [r["step"] for r in rows] == list(range(1, 61))  # continuous: nothing lost, nothing repeated
    # Checkpointed at the first step boundary after the request: the last step logged before the
    # STOP file was written, or the one in flight then. Both clocks are this host's.
    asked = datetime.fromisoformat(out.split(f"{STOP_FILE} written at ")[1].split(";")[0]).timestamp()
    asked += 0.01  # an mtime comes from the kernel's coarse clock, up to a tick behind time.time()
    before = max((r["step"] for r in rows if r["time"] <= asked), default=0)
    assert seen <= stopped and before <= stopped <= before + 1, (seen, before, stopped)
    assert f"resumed from {load_plan(rd / 'run.yaml').run.checkpoint_dir}/step{stopped:08d}" in out
    st = dskit_status(rd, cluster.env)
    assert (
        st["state"].startswith(f"COMPLETED: job {job}") and st["jobs"] == f"{job} COMPLETED, 1 requeue(s)"
    ), st
    assert (
        st["attempts"] == "1 job(s), 1 requeue(s)" and st["resumed"] == f"1 time(s), at step {stopped + 1}"
    ), st
    assert st["step"].startswith("60 / 60 (complete)") and st["last checkpoint"].split()[0].endswith(
        "step00000060"
    )


def test_expert_parallelism_across_the_two_nodes_with_zero2(cluster, tmp_path):
    """EP 2 on 2 nodes of 1 rank: every all-to-all crosses the nodes; ZeRO-2 keeps the weights whole
    and reduce-scatters gradients over the expert-data-parallel group of one. Preempted, requeued,
    resumed, finished, then exported and verified against the trained logits."""
    rd = render(
        tmp_path, "epx", steps=30, every=1000, extra=["overrides.ep_size=2", "overrides.zero_stage=2"]
    )
    plan = load_plan(rd / "run.yaml")
    assert plan.parallel.ep_size == 2 and plan.hardware.procs_per_node == 1 and plan.parallel.zero_stage == 2
    (job,) = submit(rd, cluster, tmp_path)
    seen = wait_step(rd, 8, cluster, job)
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], check=True, env=cluster.env)
    st = cluster.wait(job, 420)
    out = output(tmp_path, "epx", job)
    assert st["JobState"] == "COMPLETED" and int(st["Restarts"]) == 1, out[-3000:]
    stopped = int(out.split("stopped at step ")[1].split()[0])
    assert seen <= stopped and f"resumed from {plan.run.checkpoint_dir}/step{stopped:08d}" in out
    assert [r["step"] for r in metrics(rd)] == list(range(1, 31))
    r = dskit("export", str(rd), "-o", str(tmp_path / "hf"), check=True, timeout=900)
    assert "verified: exported logits match the trained model" in r.stdout, r.stdout


def test_a_lost_node_ends_the_job_and_a_resubmission_on_the_node_left_resumes(cluster, tmp_path):
    rd = render(tmp_path, "nodeloss", steps=40, every=3)
    job = cluster.sbatch(str(rd / "job.sbatch"), cwd=tmp_path)
    wait_step(rd, 7, cluster, job)
    ranks = [
        p
        for p in cluster.node_pids(2)
        if "dskit.train" in _cmdline(p) and "dskit.launch.torchrun" not in _cmdline(p)
    ]
    assert ranks, "no trainer process on node2"
    t0 = time.time()
    for p in ranks:
        os.kill(p, signal.SIGKILL)
    st = cluster.wait(job, 180)
    ended_after = time.time() - t0
    out = output(tmp_path, "nodeloss", job)
    assert st["JobState"] == "FAILED", st
    assert ended_after < 120, f"took {ended_after:.0f}s to end"
    assert "node2" in out.split("rank 1 of 2 on node2")[-1]  # the failure report names the lost host
    ckpt_root = Path(load_plan(rd / "run.yaml").run.checkpoint_dir)
    last = newest_verified_tag(ckpt_root)  # the last complete checkpoint is intact
    # resubmitted on the one node left: the 2-rank checkpoint resumes on 1 rank, resharded
    one = render_tiny(
        tmp_path,
        name="nodeloss1",
        steps=40,
        nodes=1,
        gpus_per_node=1,
        extra=["checkpoint.every=3", "network.interface=eth0", "slurm.partition=debug",
               f"storage.checkpoint_dir={ckpt_root}"],
    )  # fmt: skip
    job2 = cluster.sbatch(str(one / "job.sbatch"), cwd=tmp_path)
    st2 = cluster.wait(job2, 300)
    out2 = output(tmp_path, "nodeloss1", job2)
    assert st2["JobState"] == "COMPLETED", out2[-3000:]
    assert f"resharding {last.name}: world size 2 -> 1" in out2 and f"resumed from {last}" in out2
    resumed = int(last.name.removeprefix("step"))
    assert [r["step"] for r in metrics(one)] == list(range(resumed + 1, 41))


def test_a_hung_rank_ends_the_job_with_75_and_slurm_requeues_it(cluster, tmp_path):
    """SIGSTOP the rank on node2: node1's watchdog names it and exits 75, srun ends the step
    (--kill-on-bad-exit), job.sbatch reads the ranks' codes from the shared output dir and requeues; the
    requeued job resumes from the last checkpoint and finishes with contiguous steps."""
    timeout = 45
    # the teardown after the watchdog: torchrun's 30 s between SIGTERM and SIGKILL, srun's KillWait (30 s)
    rd = render(tmp_path, "hung", steps=40, every=4, extra=[f"watchdog.timeout_s={timeout}"])
    job = cluster.sbatch(str(rd / "job.sbatch"), cwd=tmp_path)
    wait_step(rd, 9, cluster, job)
    times = [r["time"] for r in metrics(rd)]
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    # the machine's measured pace, checkpoint saves included: a slower one needs a larger timeout
    assert 5 * gap < timeout, f"steps take up to {gap:.1f} s here: too slow for a {timeout} s watchdog"
    ranks = [
        p
        for p in cluster.node_pids(2)
        if "dskit.train" in _cmdline(p) and "dskit.launch.torchrun" not in _cmdline(p)
    ]
    assert ranks, "no trainer process on node2"
    for p in ranks:
        os.kill(p, signal.SIGSTOP)
    t0 = time.time()
    deadline = t0 + timeout + 60 + 30 * gap
    while cluster.state(job).get("Restarts", "0") == "0":
        assert time.time() < deadline, (
            f"not requeued {time.time() - t0:.0f} s after the hang\n{cluster.logs()}"
        )
        time.sleep(0.5)
    requeued_after = time.time() - t0
    st = cluster.wait(job, 420)
    out = output(tmp_path, "hung", job)
    assert st["JobState"] == "COMPLETED", out[-4000:]
    line = next(x for x in out.splitlines() if x.startswith("dskit: watchdog: rank 0 made no progress"))
    assert "not responding: rank 1 on node2 (pid " in line, line
    assert f"requeueing job {job}" in out and requeued_after <= timeout + 2 * 30 + 30 * gap + 10, (
        requeued_after
    )
    assert "Traceback" not in out
    resumed = int(out.split("resumed from ")[1].split("(step ")[1].split(")")[0])
    hung_at = int(line.split(" after step ")[1].split()[0])
    assert hung_at - resumed <= 4  # at most one checkpoint interval of work lost
    steps = [r["step"] for r in metrics(rd)]
    assert sorted(set(steps)) == list(range(1, 41)) and steps[-1] == 40


def test_bad_input_fails_the_job_without_a_requeue(cluster, tmp_path):
    """Exit 2 means "do not retry": the ranks' own code reaches job.sbatch (torchrun says 1)."""
    data = tmp_path / "data"
    rd = render(tmp_path, "bad", steps=10, every=5, extra=[f"data.path={data}"])  # gone when the job starts
    job = cluster.sbatch(str(rd / "job.sbatch"), cwd=tmp_path)
    st = cluster.wait(job, 300)
    out = output(tmp_path, "bad", job)
    assert st["JobState"] == "FAILED" and st["ExitCode"] == "2:0", (st, out[-3000:])
    assert int(st["Restarts"]) == 0
    assert f"dskit: error: data.path: {data / 'index.json'} not found" in out
    assert "not requeued" in out
    # No traceback of dskit's: the rank says one line. The other node's torchrun agent may still print
    # torch's own rendezvous traceback when node 1, which hosts the rendezvous store, exits first: a race
    # between the two nodes seen once in a fresh-clone CI run (c10d_rendezvous_backend.py, _call_store).
    tracebacks = out.split("Traceback (most recent call last):")[1:]
    assert all("/dskit/" not in t and "torch/distributed/elastic/" in t for t in tracebacks), out[-3000:]


def test_a_chain_of_time_limited_jobs_continues_the_run(cluster, tmp_path):
    """Two 2-minute links: Slurm signals each 40 s before its limit; each checkpoints and ends cleanly,
    and the second resumes where the first stopped. Not 1-minute links: sbatch(1) says the signal "may
    be sent up to 60 seconds earlier than specified", and a 1-minute link once got USR1 35 ms after it
    started, before its script could trap it (the job died of the signal, no output)."""
    rd = render(
        tmp_path,
        "chain",
        steps=5000,
        every=1000,
        extra=["slurm.time=0:02:00", "slurm.grace_seconds=40"],
        flags=["--chain", "2"],
    )
    jobs = submit(rd, cluster, tmp_path)
    assert len(jobs) == 2
    states = [cluster.wait(j, 400) for j in jobs]
    outs = [output(tmp_path, "chain", j) for j in jobs]
    for st, out in zip(states, outs, strict=True):
        assert st["JobState"] == "COMPLETED", (st, out[-3000:])  # ended by our checkpoint, not by TIMEOUT
        assert "USR1 received" in out and "the next link of the chain continues" in out
    stopped = int(outs[0].split("stopped at step ")[1].split()[0])
    assert f"step{stopped:08d}" in outs[1].split("resumed from ")[1].split()[0]
    steps = [r["step"] for r in metrics(rd)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > stopped
    st = dskit_status(rd, cluster.env)  # both links recorded at submission, in order
    assert st["jobs"] == f"{jobs[0]} COMPLETED; {jobs[1]} COMPLETED", st
    assert (
        st["state"].startswith(f"COMPLETED: job {jobs[1]}") and st["attempts"] == "2 job(s), 0 requeue(s)"
    ), st
    assert st["step"].startswith(f"{steps[-1]} / 5000,") and st["ETA"] == "- (not running)", st


@pytest.mark.parametrize(
    ("gpu", "runtime", "fabric"),
    [
        (g, r, f)
        for g, r, f in itertools.product(
            ("h100-80gb", "cpu"), ("pyxis", "apptainer", "none"), sorted(catalog.fabrics())
        )
    ],
)
def test_real_sbatch_accepts_every_variant(cluster, tmp_path, gpu, runtime, fabric):
    plan = build_plan(
        load_spec(
            sets=["slurm.partition=debug", "slurm.extra_args=[--mail-type=END]"],
            flags={
                "hardware.gpu": gpu,
                "runtime.kind": runtime,
                "network.fabric": fabric,
                "hardware.nodes": 2,
                "hardware.gpus_per_node": 8 if gpu != "cpu" else 2,
            },
        )
    )
    (tmp_path / "job.sbatch").write_text(slurm.render(plan, tmp_path)["job.sbatch"])
    r = subprocess.run(
        ["sbatch", "--test-only", str(tmp_path / "job.sbatch")],
        capture_output=True,
        text=True,
        env=cluster.env,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "to start at" in r.stderr, r.stderr


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
