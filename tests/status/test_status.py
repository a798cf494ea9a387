"""`dskit status RUN_DIR` without a cluster: what the rendered scripts record, the parsing of canned
scheduler answers (stub scontrol/sacct on PATH), the table from a run's files, and the one-line errors.
The real clusters answer in tests/e2e/test_slurm.py and tests/e2e/test_ray.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dskit.errors import SpecError
from dskit.launch import local_run
from dskit.launch.contract import JOBS_FILE, TARGET_FILE
from dskit.status import run_status
from tests.conftest import TINY_SETS, render_tiny
from tests.conftest import status_table as table
from tests.support.cli import cli

# Slurm 22.05's `scontrol show job -o ID` for a requeued job running again (paths with a space)
SCONTROL = (
    "JobId=12 JobName=preempt UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=1 "
    "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:42 TimeLimit=1-00:00:00 TimeMin=N/A "
    "NodeList=node[1-2] BatchHost=node1 NumNodes=2 NumCPUs=4 TRES=cpu=4,node=2,billing=4 "
    "Command=/tmp/a run/job.sbatch WorkDir=/tmp/a run StdErr=/tmp/a run/preempt-12.out StdIn=/dev/null "
    "StdOut=/tmp/a run/preempt-12.out Power="
)


def stub_bin(d: Path, scripts: dict[str, str]) -> str:
    d.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (d / name).write_text("#!/bin/bash\n" + body)
        (d / name).chmod(0o755)
    return f"{d}:/usr/bin:/bin"


def test_scontrol_line_is_parsed_with_spaces_in_values():
    info = run_status.parse_scontrol(SCONTROL)
    assert info["JobState"] == "RUNNING" and info["Restarts"] == "1"
    assert info["StdOut"] == "/tmp/a run/preempt-12.out" and info["TRES"] == "cpu=4,node=2,billing=4"
    job = run_status.slurm_job_from_scontrol("12", info)
    assert job == run_status.Job(
        "12", "RUNNING", 1, "on node[1-2], run time 00:00:42", "/tmp/a run/preempt-12.out"
    )


def test_sacct_rows_count_requeues():
    text = "7|REQUEUED|0:0|00:01:00|node1\n7|COMPLETED|0:0|00:02:00|node[1-2]\n"
    job = run_status.parse_sacct(text, "7")
    assert (job.state, job.requeues) == ("COMPLETED", 1) and "node[1-2]" in job.detail
    assert run_status.parse_sacct("", "7") is None


def test_jobs_file_skips_a_torn_line_and_repeats(tmp_path):
    (tmp_path / JOBS_FILE).write_text("5\n6\n5\n7")  # 5 twice (submit.sh and job.sbatch), 7 mid-write
    assert run_status.read_jobs(tmp_path) == [("5", None), ("6", None)]
    (tmp_path / JOBS_FILE).write_text("r-1 http://127.0.0.1:8265\n")
    assert run_status.read_jobs(tmp_path) == [("r-1", "http://127.0.0.1:8265")]


def _write_progress(rd: Path, steps: int, total_time: float) -> None:
    from dskit.plan.schema import load_plan

    plan = load_plan(rd / "run.yaml")
    out = Path(plan.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time() - total_time
    recs = [
        {"step": s, "loss": 5.0 - s / 10, "tokens_per_s_per_gpu": 1234.5, "time": t0 + s * total_time / steps}
        for s in range(1, steps + 1)
    ]
    recs.insert(5, {"step": 3, "loss": 4.7, "time": t0 + 6})  # a restart: the step went backwards
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ck = Path(plan.run.checkpoint_dir) / "step00000008"
    ck.mkdir(parents=True)
    (ck / "dskit.json").write_text("{}")
    os.utime(ck / "dskit.json", (time.time() - 90, time.time() - 90))  # saved 90 s ago
    (Path(plan.run.checkpoint_dir) / "tmp-step00000010").mkdir()  # a save in progress is not one


def test_slurm_table_from_stub_scontrol_and_the_run_files(tmp_path):
    rd = render_tiny(tmp_path, name="st", steps=40)
    assert (rd / TARGET_FILE).read_text() == "slurm\n"
    _write_progress(rd, steps=10, total_time=20.0)  # 2 s/step
    (rd / JOBS_FILE).write_text("12\n13\n")
    path = stub_bin(
        tmp_path / "bin",
        {
            "scontrol": f'if [ "$4" = 12 ]; then echo "{SCONTROL}"; else '
            'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; fi\n',
            "sacct": 'echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1\n',
        },
    )
    # on a login node without torch: status must not import it
    code = (
        "import sys; from dskit.cli import main; rc = main(['status', sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(rd)],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path},
    )
    assert r.returncode == 0, r.stderr
    rows = table(r.stdout)
    assert rows["state"].startswith("RUNNING: job 12, on node[1-2]")
    assert rows["jobs"] == "12 RUNNING, 1 requeue(s); 13 unknown"
    assert rows["attempts"] == "2 job(s), 1 requeue(s) (of 1 job(s) still known)"
    assert rows["step"].startswith("10 / 40, logged")
    assert rows["resumed"] == "1 time(s), at step 3"
    assert rows["loss"] == "4.0000"
    eta = rows["ETA"]
    assert eta.endswith("s") and 55 <= int(eta.split("m")[0]) * 60 + int(eta.split("m")[1][:-1]) <= 65, eta
    assert re.search(r"/step00000008 \(step 8, 1m3[0-3]s ago\)$", rows["last checkpoint"]), rows
    assert rows["log"] == "/tmp/a run/preempt-12.out"


def test_a_forgotten_job_with_accounting_comes_from_sacct(tmp_path):
    rd = render_tiny(tmp_path, name="acct", steps=40)
    (rd / JOBS_FILE).write_text("7\n")
    path = stub_bin(
        tmp_path / "bin",
        {
            "scontrol": 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n',
            "sacct": 'echo "7|REQUEUED|0:0|00:01:00|node1"; echo "7|COMPLETED|0:0|00:02:00|node[1-2]"\n',
        },
    )
    r = cli("status", str(rd), env={"PATH": path})
    assert r.returncode == 0, r.stderr
    rows = table(r.stdout)
    assert rows["state"].startswith("COMPLETED: job 7, exit code 0:0")
    assert rows["attempts"] == "1 job(s), 1 requeue(s)"
    assert rows["step"].startswith("- / 40 (no metrics in") and rows["last checkpoint"].startswith("none yet")


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (lambda rd: None, "not submitted yet (no job in jobs) — run bash"),
        (lambda rd: (rd / JOBS_FILE).write_text("12\n"), "scontrol not found: run this where"),
        (lambda rd: (rd / JOBS_FILE).write_text("12; rm -rf /\n"), "not a job record"),
        (lambda rd: (rd / TARGET_FILE).write_text("lsf\n"), "names an unknown target 'lsf'"),
        (lambda rd: (rd / local_run.RECORD).write_text("{"), "local-run.json: unreadable"),
        (lambda rd: (rd / local_run.RECORD).write_text('{"pid": "7"}'), "is not a record of dskit train"),
        *(
            (lambda rd, v=v: (rd / local_run.RECORD).write_text(v), "is not a record of dskit train")
            for v in (
                '{"pid": 7, "host": "h", "started": -Infinity}',
                '{"pid": 7, "host": "h", "started": 1e300}',
                '{"pid": 1000000000000000000000000000000, "host": "h", "started": 1.8e9}',
                '{"pid": 7, "host": "h", "started": 1.8e9, "ended": NaN, "exit_code": 0}',
                '{"pid": true, "host": "h", "started": 1.8e9}',
            )
        ),
    ],
)
def test_errors_are_one_line_exit_2(tmp_path, setup, words):
    rd = render_tiny(tmp_path, name="err", steps=4)
    setup(rd)
    r = cli("status", str(rd), env={"PATH": "/nonexistent"})
    assert r.returncode == 2 and r.stdout == "", r
    (line,) = r.stderr.splitlines()
    assert line.startswith("dskit: error: ") and words in line, line


@pytest.mark.parametrize("folder", ["plain", "a $(touch pwned) 'q'"])
def test_a_run_dir_neither_submitted_nor_trained_here_says_both_ways(tmp_path, folder):
    """Both suggested commands are pasteable as printed: the run dir is one shell word whatever it holds."""
    (tmp_path / folder).mkdir()
    rd = render_tiny(tmp_path / folder, name="new", steps=4)
    r = cli("status", str(rd), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    line = r.stderr.rstrip()
    submit = line.split(" — run ", 1)[1].split(" (", 1)[0]
    assert shlex.split(submit) == ["bash", str(rd / "submit.sh")], submit
    train = line.split("or train it here: ", 1)[1]
    assert shlex.split(train) == ["dskit", "train", "--local", str(rd)], train
    subprocess.run(["bash", "-c", f"true {train}"], cwd=tmp_path, check=True)
    assert not (tmp_path / "pwned").exists()


def _status_rows(rd: Path, capsys) -> dict[str, str]:
    """`dskit status RUN_DIR` in this process (a lock this process holds is seen as another's would be:
    flock locks belong to the open file, not to the process)."""
    from dskit.cli import main

    assert main(["status", str(rd)]) == 0, capsys.readouterr().err
    return table(capsys.readouterr().out)


def test_a_local_runs_end_is_its_state(tmp_path, capsys):
    """What `dskit train --local` records at its end (dskit/launch/local_run.py), as `dskit status` shows it:
    the trainer's exit codes by their meaning (dskit/launch/contract.py), a signal by its name."""
    rd = render_tiny(tmp_path, name="loc", steps=4)
    ends = [
        (0, None, "finished: dskit train --local, exit 0, ran "),
        (
            75,
            None,
            "stopped: dskit train --local, checkpointed on request (exit 75); the same command resumes",
        ),
        (2, None, "failed: dskit train --local, bad input (exit 2)"),
        (74, None, "failed: dskit train --local, checkpoint disk full (exit 74)"),
        (1, None, "failed: dskit train --local, exit 1: its output says why"),
        (-9, None, "failed: dskit train --local, torchrun was killed by SIGKILL"),
        (143, None, "failed: dskit train --local, torchrun was stopped by SIGTERM (exit 143)"),
        (
            None,
            "KeyboardInterrupt",
            "failed: dskit train --local, the launcher was interrupted (KeyboardInterrupt)",
        ),
    ]
    for code, interrupted, state in ends:
        local_run.end(local_run.start(rd), code, interrupted)
        rows = _status_rows(rd, capsys)
        assert rows["run"] == f"loc (slurm, trained locally) {rd}"
        assert rows["state"].startswith(state) and rows["state"].endswith("s ago"), (code, rows["state"])
        assert rows["step"].startswith("- / 4 (no metrics in") and rows["last checkpoint"].startswith(
            "none yet"
        )
    assert [p.name for p in rd.glob(f"*{local_run.RECORD}*")] == [local_run.RECORD]  # no temporary left


def test_a_local_run_is_running_while_its_launcher_holds_the_record(tmp_path, capsys):
    """The record's lock is held while the launcher lives: running, with its pid; a launcher killed
    before it could record its end (kill -9) leaves a record whose lock the kernel dropped."""
    rd = render_tiny(tmp_path, name="alive", steps=4)
    held = local_run.start(rd)
    try:
        rows = _status_rows(rd, capsys)
    finally:
        local_run.end(held, 0)
    assert rows["state"].startswith(f"running: dskit train --local, pid {os.getpid()} on ")
    code = "import os, pathlib, signal, sys; from dskit.launch import local_run; "
    code += "local_run.start(pathlib.Path(sys.argv[1])); os.kill(os.getpid(), signal.SIGKILL)"
    killed = subprocess.Popen([sys.executable, "-c", code, str(rd)])
    assert killed.wait() == -signal.SIGKILL
    rows = _status_rows(rd, capsys)
    assert rows["state"].startswith(f"killed: dskit train --local (pid {killed.pid} on "), rows["state"]
    assert "ended without recording an exit" in rows["state"]


def test_a_directory_without_run_yaml_is_not_taken_for_a_release(tmp_path):
    r = cli("status", str(tmp_path))
    assert r.returncode == 2 and "is not a run directory (no run.yaml in it)" in r.stderr
    rd = render_tiny(tmp_path, name="slurmrun", steps=4)
    r = cli("status", str(rd), "--address", "http://127.0.0.1:1")
    assert r.returncode == 2 and "--address: is for Ray runs" in r.stderr


def test_slurm_submit_records_every_job_id_quoted(tmp_path):
    """submit.sh (a chain of 3) under a stub sbatch, in a run dir whose path needs quoting."""
    rd = render_tiny(tmp_path / "a b'c", name="chain", steps=4, flags=["--chain", "3"])
    log = tmp_path / "sbatch.args"
    path = stub_bin(
        tmp_path / "bin",
        {
            "sbatch": f'n=$(( $(wc -l < "{log}" 2>/dev/null || echo 0) + 41 )); echo "$@" >> "{log}"; '
            'echo "${n};dsktest"\n'
        },
    )
    r = subprocess.run(
        ["bash", str(rd / "submit.sh"), "--qos=low"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["link 1: job 41", "link 2: job 42", "link 3: job 43"]
    assert run_status.read_jobs(rd) == [("41", None), ("42", None), ("43", None)]
    args = log.read_text().splitlines()
    assert args[1] == f"--parsable --qos=low --dependency=afterany:41 {rd}/job.sbatch"


def test_job_sbatch_records_its_own_id_once(tmp_path):
    rd = render_tiny(tmp_path, name="self", steps=4)
    script = (rd / "job.sbatch").read_text()
    block = script[script.index("# `dskit status RUN_DIR` reads") : script.index("launch=(")]
    for _ in range(2):  # a requeued job starts again under the same id
        r = subprocess.run(
            ["bash", "-euc", block],
            env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77", "DSKIT_RUN_DIR": str(rd)},
        )
        assert r.returncode == 0
    assert (rd / JOBS_FILE).read_text() == "77\n"


def test_ray_submit_records_the_submission_id_and_address(tmp_path):
    rd = render_tiny(tmp_path, name="rayrec", steps=4, target="ray")
    assert (rd / TARGET_FILE).read_text() == "ray\n"
    path = stub_bin(tmp_path / "bin", {"ray": 'printf "%s\\n" "$@" > "$(dirname "$0")/args"\n'})
    env = {**os.environ, "PATH": path, "RAY_ADDRESS": "http://10.0.0.9:8265"}
    r = subprocess.run(["bash", str(rd / "submit.sh"), "--no-wait"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    ((sid, addr),) = run_status.read_jobs(rd)
    assert sid.startswith("rayrec-") and addr == "http://10.0.0.9:8265"
    args = (tmp_path / "bin" / "args").read_text().splitlines()
    assert args[args.index("--submission-id") + 1] == sid and "--no-wait" in args
    r = subprocess.run(["bash", str(rd / "submit.sh"), "--address", "http://127.0.0.1:1"], env=env)
    assert run_status.read_jobs(rd)[-1][1] == "http://127.0.0.1:1"
    r = subprocess.run(
        ["bash", str(rd / "submit.sh"), "--submission-id=x"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 2 and "chooses the submission id itself" in r.stderr


def test_every_render_records_its_target(tmp_path):
    for target in ("helm", "image"):
        out = tmp_path / target
        cli(
            "render",
            target,
            "--gpu",
            "cpu",
            "-o",
            str(out),
            "--set",
            f"storage.root={tmp_path}/s",
            check=True,
        )
        assert (out / TARGET_FILE).read_text() == f"{target}\n"
    r = cli("status", str(tmp_path / "image"))
    assert r.returncode == 2 and "rendered for the image target, which has no job" in r.stderr


def test_ray_jobs_through_the_job_client(monkeypatch):
    """Canned answers of Ray's client: the latest submission speaks; an earlier one on a cluster that
    is gone is unknown; the latest one's cluster not answering is one error."""
    job_submission = pytest.importorskip("ray.job_submission")
    from types import SimpleNamespace

    class Client:
        def __init__(self, address):
            if "gone" in address:
                raise ConnectionError(f"Failed to connect to Ray at address: {address}.")
            self.address = address

        def get_job_info(self, job_id):
            if job_id == "lost":
                raise RuntimeError("Request failed with status code 404: Job lost does not exist.")
            return SimpleNamespace(
                status=job_submission.JobStatus.RUNNING, message="Job is currently running."
            )

    monkeypatch.setattr(job_submission, "JobSubmissionClient", Client)
    jobs = run_status.ray_jobs([("a", "http://gone:1"), ("lost", "http://h:2"), ("b", "http://h:2")], None)
    assert [(j.id, j.state) for j in jobs] == [("a", "unknown"), ("lost", "unknown"), ("b", "RUNNING")]
    assert jobs[-1].log == "ray job logs --address http://h:2 b"
    assert run_status.ray_jobs([("b", "http://gone:1")], "http://h:3")[0].state == "RUNNING"  # --address
    with pytest.raises(SpecError, match="cannot reach the Ray cluster at http://gone:1"):
        run_status.ray_jobs([("b", "http://gone:1")], None)


def test_a_helm_run_dir_asks_for_the_release_named_like_the_run(tmp_path, monkeypatch, capsys):
    """No kube-apiserver here: the Kubernetes clients are stand-ins answering one running Job."""
    from types import SimpleNamespace as NS

    from dskit import cli
    from dskit.status import k8s

    rd = render_tiny(tmp_path, name="helmrun", steps=40, target="helm")
    _write_progress(rd, steps=10, total_time=20.0)
    asked = []

    class Api:
        def list_namespaced_job(self, namespace, label_selector, _request_timeout):
            asked.append((namespace, label_selector))
            status = NS(conditions=None, active=1, succeeded=0, failed=0)
            return NS(items=[NS(metadata=NS(name="helmrun"), status=status, spec=NS(backoff_limit=3))])

        def list_namespaced_pod(self, namespace, label_selector, _request_timeout):
            return NS(items=[])

    pytest.importorskip("kubernetes")
    monkeypatch.setattr(k8s, "_clients", lambda kubeconfig, context: (Api(), Api()))
    assert cli.main(["status", str(rd), "-n", "ml"]) == 0
    out = capsys.readouterr().out
    assert asked == [("ml", "app.kubernetes.io/name=dskit,app.kubernetes.io/instance=helmrun")]
    assert out.startswith("job helmrun: running; active 1, succeeded 0, failed 0 of backoffLimit 3\n")
    rows = table(out.split("\n", 2)[2])  # after the job line and the (empty) pod table's header
    assert rows["run"] == f"helmrun (helm release helmrun, namespace ml) {rd.resolve()}"
    assert rows["step"].startswith("10 / 40, logged") and rows["ETA"].endswith("(if it is running)")


def test_a_target_added_only_to_the_registry_renders_and_answers_status(tmp_path, monkeypatch, capsys):
    """docs/architecture.md's recipe: a target is one `Target` in TARGETS, nothing else. A fake
    scheduler's target, registered here only (monkeypatch restores TARGETS), is rendered by `dskit
    render` and asked about by `dskit status`."""
    from dskit import cli
    from dskit.render import TARGETS, Step, Target
    from dskit.render.common import run_files

    submit = "fake-submit.sh"

    def render(plan, out):
        return {**run_files(plan), submit: f"#!/bin/bash\necho fake-1 >> '{out / JOBS_FILE}'\n"}

    asked = []

    def ask(entries, query):
        asked.append(entries)
        jobs = [run_status.Job(job_id, "RUNNING", None, "on the fake cluster") for job_id, _ in entries]
        return jobs, jobs[-1], f"{len(jobs)} fake submission(s)"

    fake = Target(
        "fake",
        "a fake scheduler's job",
        render,
        (submit,),
        lambda plan, out, files: [Step("next", ("bash", out / submit))],
        run_status.RecordedJobs(ask, submit, "nothing else records a fake job"),
    )
    monkeypatch.setitem(TARGETS, "fake", fake)
    rd = tmp_path / "fake"
    args = ["render", "fake", "--gpu", "cpu", "-o", str(rd), "--set", f"storage.root={tmp_path}/s"]
    assert cli.main(args) == 0
    assert capsys.readouterr().out.endswith(f"next: bash {rd / submit}\n")
    assert (rd / TARGET_FILE).read_text() == "fake\n" and os.access(rd / submit, os.X_OK)

    assert cli.main(["status", str(rd)]) == 2
    err = capsys.readouterr().err
    assert f"not submitted yet (no job in jobs) — run bash {rd / submit} (nothing else records" in err
    assert cli.main(["status", str(rd), "--address", "http://127.0.0.1:1"]) == 2
    assert "--address: is for Ray runs" in capsys.readouterr().err

    subprocess.run(["bash", str(rd / submit)], check=True)
    assert cli.main(["status", str(rd)]) == 0
    rows = table(capsys.readouterr().out)
    assert asked == [[("fake-1", None)]]
    assert rows["run"].endswith(f"(fake) {rd}")
    assert rows["state"] == "RUNNING: job fake-1, on the fake cluster"
    assert rows["attempts"] == "1 fake submission(s)" and rows["step"].startswith("- / ")


def test_a_second_trainer_on_a_run_dir_being_trained_is_one_line_and_exit_2(tmp_path):
    """A second `dskit train --local`, or a `render --force` of the run dir, would write under the trainer:
    refused while the record says running (this machine's lock), and where another machine's record cannot
    be checked; each refusal names the record to delete if that run is gone. Two launchers that pass the
    check together are told apart by the run dir's lock. An ended run is no obstacle: the same command
    resumes it."""
    rd = render_tiny(tmp_path, name="busy", steps=4)
    held = local_run.start(rd)
    try:
        train = cli("train", "--local", str(rd))
        sets = [w for x in TINY_SETS for w in ("--set", x)]
        render = cli("render", "slurm", "--gpu", "cpu", "--model", "tiny-v2", "-o", str(rd), "--force", *sets)
        with pytest.raises(
            SpecError, match="being trained by another `dskit train --local` that started just now"
        ):
            local_run.start(rd)  # a second launcher past the record's check at the same moment
    finally:
        local_run.end(held, 0)
    for r, why in ((train, "a second trainer would write"), (render, "--force would replace its run dir")):
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"being trained (dskit train --local, pid {os.getpid()} on " in r.stderr and why in r.stderr
        assert "kill -USR1" in r.stderr and f"if that run is gone, delete {rd / local_run.RECORD}" in r.stderr
    assert "+ " not in train.stdout and (rd / "job.sbatch").is_file()  # refused before torchrun; kept
    local_run.refuse_while_trained(rd, "-")  # ended: nothing in the way
    local_run.end(local_run.start(rd), 0)  # and the run dir's lock was let go
    elsewhere = {"written_by": local_run.WRITER, "host": "other-host", "pid": 4242, "started": time.time()}
    elsewhere.update(boot_id="0" * 32, machine="1" * 32)
    (rd / local_run.RECORD).write_text(json.dumps(elsewhere))
    r = cli("train", "--local", str(rd))
    assert r.returncode == 2 and "another machine: not checkable here" in r.stderr and "kill" not in r.stderr
    assert f"if that run is gone, delete {rd / local_run.RECORD}" in r.stderr
