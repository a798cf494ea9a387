"""`dskit status RUN_DIR`: where a rendered run stands, whatever the target, in one table.

The run directory says which target it was rendered for (TARGET_FILE) and which jobs were submitted
from it (JOBS_FILE, appended by the rendered submit.sh, and by job.sbatch when a plain `sbatch` job
starts). That target's entry in dskit.render.TARGETS, which the caller hands in, names how its jobs are
asked about (`Target.status`: one of the strategies at the end of this module, which the registry
imports: this module never imports the registry back). The schedulers answer: Slurm
through `scontrol show job` (the job's state, `Restarts=` = requeues; after slurmctld forgets a
finished job, MinJobAge, through `sacct` where accounting is configured, else the state is reported
as unknown), Ray through its job client, Helm through the Kubernetes API (dskit.status.k8s, the
release named like the run). Step, loss, throughput, ETA and the last checkpoint come from the run's
own files: OUTPUT_DIR/metrics.jsonl, read with `dskit report`'s reader, and the checkpoint dir's
complete tags. A run dir trained on this machine (`dskit train --local`) has no job to ask about: its
state comes from the record the local launcher keeps in it (dskit/launch/local_run.py).

No torch, and nothing beyond dskit's core dependencies (plus ray's client for a Ray run, the
kubernetes client for a Helm run): it runs on a login node without the train extra.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dskit.errors import SpecError
from dskit.formats.checkpoint_layout import DONE, TAG_RE, complete_tags
from dskit.io import bounded_read
from dskit.io.text import command, escape
from dskit.launch import local_run
from dskit.launch.contract import COMPLETE_FILE, JOBS_FILE, METRICS_FILE, RUN_YAML, TARGET_FILE

SLURM_ID_RE = re.compile(r"[0-9]{1,18}")
RAY_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
DEFAULT_RAY_ADDRESS = "http://127.0.0.1:8265"  # what the rendered ray/submit.sh uses without RAY_ADDRESS
#: Slurm and Ray states in which the trainer is (or is about to be) running: the ETA is shown then.
ACTIVE = {"RUNNING", "CONFIGURING", "COMPLETING", "SIGNALING", "STAGE_OUT"}
WAITING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}
TIMEOUT_S = 30


@dataclass(frozen=True)
class Job:
    id: str
    state: str  # the scheduler's word: RUNNING, PENDING, COMPLETED, SUCCEEDED, ... or "unknown"
    requeues: int | None = None  # Slurm Restarts=; None where the scheduler does not say
    detail: str = ""  # where or why: nodes and run time, a pending reason, the scheduler's message
    log: str | None = None  # where its output goes


@dataclass(frozen=True)
class Query:
    """What `dskit status RUN_DIR` was given besides the run dir; each target's status reads its own."""

    address: str | None = None  # Ray's dashboard; None: the one submit.sh recorded
    namespace: str = "default"  # Kubernetes
    kubeconfig: str | None = None
    context: str | None = None


#: (job id, Ray address or None) per recorded submission, oldest first: what read_jobs returns
Entries = list[tuple[str, str | None]]
#: a scheduler's answer about them: every job, the one that speaks for the run, the attempts row
Asked = tuple[list[Job], Job, str]


def is_run_dir(arg: str) -> bool:
    """`dskit status ARG`: a directory `dskit render` wrote (run.yaml, or TARGET_FILE for an image) is
    a run dir; anything else a Helm release name."""
    return (Path(arg) / RUN_YAML).is_file() or (Path(arg) / TARGET_FILE).is_file()


class Registered(Protocol):
    """What status needs of a registered target (dskit.render.Target)."""

    name: str
    status: Status
    sign: str | None


#: the target's name; one line per submission (a job id, a Ray address): thousands of requeues fit
MAX_TARGET_FILE, MAX_JOBS_FILE = 4 << 10, 4 << 20


def _read(f: Path, limit: int) -> str:
    """A run dir's own text file, within its limit; SpecError naming it otherwise."""
    try:
        return bounded_read.read_bytes(f, limit=limit, what=f"a run's {f.name}").decode(errors="replace")
    except bounded_read.TooLarge as e:
        raise SpecError(str(f), e.reason) from None


def target_of(run_dir: Path, targets: Mapping[str, Registered]) -> Registered:
    """The registered target (of `targets`, dskit.render.targets) a run dir was rendered for."""
    f = run_dir / TARGET_FILE
    if f.is_file():
        name = _read(f, MAX_TARGET_FILE).strip()
        if name not in targets:
            raise SpecError(str(f), f"names an unknown target {name!r}; re-render the run directory")
        return targets[name]
    for target in targets.values():  # rendered by a dskit that did not record the target
        if target.sign is not None and (run_dir / target.sign).is_file():
            return target
    raise SpecError(str(run_dir), f"no {TARGET_FILE} file: render it with `dskit render TARGET`")


def read_jobs(run_dir: Path) -> Entries:
    """(job id, Ray address or None) per submission, oldest first, each once. A last line without its
    newline is a write in progress and is skipped."""
    f = run_dir / JOBS_FILE
    if not f.is_file():
        return []
    text = _read(f, MAX_JOBS_FILE)
    lines = text.split("\n")[:-1]  # the part after the last newline is not a whole line
    seen: dict[str, str | None] = {}
    for n, line in enumerate(lines, 1):
        words = line.split()
        if not words:
            continue
        if len(words) > 2 or not RAY_ID_RE.fullmatch(words[0]):
            raise SpecError(f"{f}:{n}", f"not a job record: {line[:80]!r} (JOBID [ADDRESS] per line)")
        seen.setdefault(words[0], words[1] if len(words) > 1 else None)
    return list(seen.items())


# --------------------------------------------------------------------------- Slurm


def parse_scontrol(line: str) -> dict[str, str]:
    """`scontrol show job -o ID`: one line of Key=Value pairs. Values may hold spaces (paths), so a
    pair ends where the next `Key=` begins."""
    pairs = re.split(r" (?=[A-Za-z][A-Za-z0-9_:/]*=)", line.strip())
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def parse_sacct(text: str, job_id: str) -> Job | None:
    """`sacct -n -P -X -D -j ID -o JobID,State,ExitCode,Elapsed,NodeList`: with -D a requeued job
    has one row per run, the earlier ones in state REQUEUED; the last row is its state now."""
    rows = [r.split("|") for r in text.splitlines() if r.split("|")[0] == job_id]
    if not rows:
        return None
    last = rows[-1] + [""] * 5
    requeues = sum(1 for r in rows[:-1] if r[1].split()[0:1] == ["REQUEUED"])
    state = (last[1].split() or ["unknown"])[0]
    return Job(job_id, state, requeues, f"exit code {last[2]}, ran {last[3]} on {last[4] or '-'} (sacct)")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        raise SpecError(
            "dskit status", f"{cmd[0]} not found: run this where the scheduler's commands are (a login node)"
        )
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SpecError("dskit status", f"{' '.join(cmd)} did not answer in {TIMEOUT_S} s") from None


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "no output")


def _ray_detail(message: str) -> str:
    """Ray's message for a failed job quotes the entrypoint's last logs: the dskit error line there
    (the driver's last word, dskit/launch/ray_train.py) says why in one line."""
    errors = [ln.strip() for ln in message.splitlines() if ln.strip().startswith("dskit: error: ")]
    if errors:
        head = message.split(",", 1)[0] if "exit code" in message.split("\n", 1)[0] else ""
        return (f"{head}: " if head else "") + errors[-1][len("dskit: error: ") :][:300]
    return message.strip().replace("\n", " ")[:160]


def slurm_job_from_scontrol(job_id: str, info: dict[str, str]) -> Job:
    state = info.get("JobState", "unknown")
    restarts = info.get("Restarts", "")
    if state in WAITING:
        detail = f"reason {info.get('Reason', '?')}"
    else:
        detail = f"on {info.get('NodeList', '-')}, run time {info.get('RunTime', '?')}"
        if state not in ACTIVE:
            detail += f", exit code {info.get('ExitCode', '?')}"
    return Job(
        job_id,
        state,
        int(restarts) if restarts.isdigit() else None,
        detail,
        info.get("StdOut") or None,
    )


def slurm_jobs(ids: list[str]) -> list[Job]:
    out = []
    for job_id in ids:
        if not SLURM_ID_RE.fullmatch(job_id):
            raise SpecError(JOBS_FILE, f"{job_id!r} is not a Slurm job id")
        r = _run(["scontrol", "show", "job", "-o", job_id])
        if r.returncode == 0 and "JobState=" in r.stdout:
            out.append(slurm_job_from_scontrol(job_id, parse_scontrol(r.stdout.splitlines()[0])))
            continue
        if "Invalid job id" not in r.stderr + r.stdout:
            raise SpecError("dskit status", f"scontrol show job {job_id}: {_first_line(r.stderr + r.stdout)}")
        # slurmctld forgot the job (it ended more than MinJobAge ago): the accounting database knows it
        a = _run(
            ["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "JobID,State,ExitCode,Elapsed,NodeList"]
        )
        job = parse_sacct(a.stdout, job_id) if a.returncode == 0 else None
        if job is None:
            why = _first_line(a.stderr) if a.returncode else "no record"
            job = Job(job_id, "unknown", None, f"ended and forgotten by slurmctld; sacct: {why}")
        out.append(job)
    return out


def slurm_summary(jobs: list[Job]) -> tuple[Job, str]:
    """The job that speaks for the run (a running one, else a waiting one, else the last) and the
    attempts row: jobs and requeues (each requeue is one more start of the same job)."""
    current = next(
        (j for j in jobs if j.state in ACTIVE), next((j for j in jobs if j.state in WAITING), jobs[-1])
    )
    known = [j.requeues for j in jobs if j.requeues is not None]
    requeues = f"{sum(known)} requeue(s)" if known else "requeues unknown"
    if known and len(known) < len(jobs):
        requeues += f" (of {len(known)} job(s) still known)"
    return current, f"{len(jobs)} job(s), {requeues}"


def ask_slurm(entries: Entries, query: Query) -> Asked:
    jobs = slurm_jobs([job_id for job_id, _ in entries])
    return (jobs, *slurm_summary(jobs))


# --------------------------------------------------------------------------- Ray


def ray_jobs(entries: Entries, address: str | None) -> list[Job]:
    try:
        from ray.job_submission import JobSubmissionClient
    except ModuleNotFoundError:
        raise SpecError("dskit status", "needs Ray's job client: pip install 'dskit[ray]'") from None
    clients: dict[str, Any] = {}
    out = []
    for n, (job_id, recorded) in enumerate(entries, 1):
        addr = address or recorded or DEFAULT_RAY_ADDRESS
        if addr not in clients:
            try:
                clients[addr] = JobSubmissionClient(addr)
            except Exception as e:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError by address
                if n < len(entries):  # an earlier submission's cluster may be gone: the latest matters
                    clients[addr] = None
                else:
                    raise SpecError(
                        "dskit status", f"cannot reach the Ray cluster at {addr}: {_first_line(str(e))}"
                    ) from None
        if clients[addr] is None:
            out.append(Job(job_id, "unknown", None, f"the Ray cluster at {addr} does not answer"))
            continue
        try:
            info = clients[addr].get_job_info(job_id)
        except Exception as e:  # noqa: BLE001 - RuntimeError for an unknown id, requests' errors
            msg = _first_line(str(e))
            if "does not exist" in msg or "404" in msg:
                out.append(Job(job_id, "unknown", None, f"not known to the Ray cluster at {addr}"))
                continue
            raise SpecError("dskit status", f"Ray job {job_id} at {addr}: {msg}") from None
        state = str(getattr(info.status, "value", info.status))
        detail = _ray_detail(info.message or "")
        out.append(
            Job(job_id, state, None, detail, command(["ray", "job", "logs", "--address", addr, job_id]))
        )
    return out


def ask_ray(entries: Entries, query: Query) -> Asked:
    jobs = ray_jobs(entries, query.address)  # the latest submission speaks for the run
    return jobs, jobs[-1], f"{len(jobs)} submission(s)"


# --------------------------------------------------------------------------- the run's own files


def _ago(seconds: float) -> str:
    from dskit.train.progress import format_eta

    return f"{format_eta(max(0.0, seconds))} ago"


def seconds_per_step(records: list[dict[str, Any]], restarts: list[int]) -> float | None:
    """From the log records of the current segment (since the last restart): wall time between its
    first and last record over the steps between them; with one record, its own step time."""
    seg = [r for r in records if not restarts or r["step"] >= restarts[-1]]
    timed = [r for r in seg if isinstance(r.get("time"), (int, float))]
    if len(timed) >= 2 and timed[-1]["step"] > timed[0]["step"]:
        return (timed[-1]["time"] - timed[0]["time"]) / (timed[-1]["step"] - timed[0]["step"])
    last = seg[-1] if seg else None
    return last.get("step_time_s") if last else None


def progress_rows(
    plan: Any, run_dir: Path, running: bool | None, now: float | None = None
) -> list[tuple[str, str]]:
    """Step/total, loss, tokens/s, ETA and the last checkpoint from the run's files. `running`: what
    the scheduler says (None: not asked; the ETA then assumes the run goes on)."""
    from dskit.status.report import balance_text, locate, read_metrics
    from dskit.train.progress import format_eta, throughput_text

    now = time.time() if now is None else now
    total = plan.optim.steps
    out_dir = locate(run_dir).output_dir
    complete = (Path(plan.run.output_dir) / COMPLETE_FILE).is_file()
    metrics = out_dir / METRICS_FILE
    s = read_metrics(metrics) if metrics.is_file() else None
    rows: list[tuple[str, str]] = []
    if s is None or not s.records:
        rows.append(("step", f"- / {total} (no metrics in {metrics}: none logged yet, or not visible here)"))
    else:
        last = s.records[-1]
        when = f", logged {_ago(now - last['time'])}" if isinstance(last.get("time"), (int, float)) else ""
        rows.append(("step", f"{last['step']} / {total}{' (complete)' if complete else ''}{when}"))
        if s.restarts:
            rows.append(("resumed", f"{len(s.restarts)} time(s), at step {', '.join(map(str, s.restarts))}"))
        loss = last.get("loss")
        rows.append(("loss", "-" if loss is None else f"{loss:.4f}"))
        rows.append(("tokens/s/GPU", throughput_text(last)))
        if balance := balance_text(last):
            rows.append(("expert balance", balance))
        if complete:
            eta = "done"
        elif running is not False:
            rate = seconds_per_step(s.records, s.restarts)
            eta = format_eta(rate * (total - last["step"]) if rate else None)
            eta += "" if running else " (if it is running)"
        else:
            eta = "- (not running)"
        rows.append(("ETA", eta))
    rows.append(("last checkpoint", last_checkpoint(Path(plan.run.checkpoint_dir), now)))
    return rows


def last_checkpoint(root: Path, now: float) -> str:
    tags = complete_tags(root)
    if not tags:
        return f"none yet (in {root})"
    done = root / tags[0] / DONE
    m = TAG_RE.match(tags[0])
    step = int(m.group(1)) if m else "?"
    try:
        age = f", {_ago(now - done.stat().st_mtime)}"
    except OSError:
        age = ""
    return f"{root / tags[0]} (step {step}{age})"


# --------------------------------------------------------------------------- table


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {escape(v)}" for k, v in rows)


def _jobs_cell(jobs: list[Job], shown: int = 6) -> str:
    def one(j: Job) -> str:
        extra = f", {j.requeues} requeue(s)" if j.requeues else ""
        return f"{j.id} {j.state}{extra}"

    cells = [one(j) for j in jobs[-shown:]]
    more = f"{len(jobs) - shown} earlier, " if len(jobs) > shown else ""
    return more + "; ".join(cells)


def status(
    run_dir: str | Path,
    targets: Mapping[str, Registered],
    *,
    address: str | None = None,
    namespace: str = "default",
    kubeconfig: str | None = None,
    context: str | None = None,
) -> int:
    d = Path(run_dir).resolve()
    target = target_of(d, targets)
    if address and not target.status.takes_address:
        raise SpecError("--address", f"is for Ray runs; {d} was rendered for {target.name}")
    print(target.status.text(d, target.name, Query(address, namespace, kubeconfig, context)))
    return 0


# --------------------------------------------------------------------------- the targets' strategies


class Status(Protocol):
    """How `dskit status` finds and describes the job of one target's run dir (`Target.status`)."""

    #: whether --address (Ray's dashboard) means anything for it; refused otherwise
    takes_address: bool

    def text(self, run_dir: Path, target: str, query: Query) -> str:
        """The whole answer, built before anything is printed; a SpecError is the one error line."""
        ...


@dataclass(frozen=True)
class RecordedJobs:
    """The target's submit script appends each job it submits to JOBS_FILE; `ask` asks its scheduler
    about them."""

    ask: Callable[[Entries, Query], Asked]
    submit: str  # the run dir's script that submits and records
    unrecorded: str  # how a job may be submitted without a record: the not-submitted hint says
    takes_address: bool = False

    def text(self, run_dir: Path, target: str, query: Query) -> str:
        from dskit.plan.schema import load_plan

        plan = load_plan(run_dir / RUN_YAML)
        entries = read_jobs(run_dir)
        local = local_run.read(run_dir)
        if not entries and local is not None:  # trained on this machine only (`dskit train --local`)
            return format_table(
                [
                    ("run", f"{plan.name} ({target}, trained locally) {run_dir}"),
                    ("state", local.text()),
                    *progress_rows(plan, run_dir, running=local.running),
                ]
            )
        if not entries:
            raise SpecError(
                str(run_dir),
                f"not submitted yet (no job in {JOBS_FILE}) — run {command(['bash', run_dir / self.submit])} "
                f"({self.unrecorded}), or train it here: {command(['dskit', 'train', '--local', run_dir])}",
            )
        jobs, current, attempts = self.ask(entries, query)
        state = f"{current.state}: job {current.id}" + (f", {current.detail}" if current.detail else "")
        rows = [
            ("run", f"{plan.name} ({target}) {run_dir}"),
            ("state", state),
            ("jobs", _jobs_cell(jobs)),
            ("attempts", attempts),
            *(() if local is None else [("local run", local.text())]),
            *progress_rows(plan, run_dir, running=current.state in ACTIVE),
        ]
        if current.log:
            rows.append(("log", current.log))
        return format_table(rows)


@dataclass(frozen=True)
class HelmRelease:
    """The release `dskit render helm` proposed (`helm install NAME ...`, NAME the run's name): its
    workload (Job, JobSet or TrainJob) and pods through the Kubernetes API (dskit.status.k8s), then
    the run's files."""

    takes_address: bool = False

    def text(self, run_dir: Path, target: str, query: Query) -> str:
        from dskit.plan.schema import load_plan
        from dskit.status import k8s

        plan = load_plan(run_dir / RUN_YAML)
        rows = [("run", f"{plan.name} (helm release {plan.name}, namespace {query.namespace}) {run_dir}")]
        rows += progress_rows(plan, run_dir, running=None)
        pods = k8s.status_text(
            plan.name,
            query.namespace,
            workload=plan.kubernetes.workload,  # a JobSet or TrainJob is asked about besides its Jobs
            kubeconfig=query.kubeconfig,
            context=query.context,
        )
        return f"{pods}\n{format_table(rows)}"


@dataclass(frozen=True)
class NoJob:
    """A target whose run dir submits nothing to ask about (an image is built, not run)."""

    takes_address: bool = False

    def text(self, run_dir: Path, target: str, query: Query) -> str:
        raise SpecError(str(run_dir), f"rendered for the {target} target, which has no job to ask about")
