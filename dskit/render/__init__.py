"""Render targets: the one registry of what a target is. Each target is one `Target` in `TARGETS`: how a
plan becomes its run directory's files, how its job is submitted, and how `dskit status` asks about it.
`dskit render TARGET` (dskit/render/run_dir.py), `dskit status RUN_DIR` (dskit/status/run_status.py) and the
bench scripts only look targets up here, so adding a target is adding an entry here (and its module
beside this one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dskit.io.text import command
from dskit.launch.contract import TARGET_FILE
from dskit.plan.schema import Plan
from dskit.render import helm, image, ray, slurm
from dskit.status.run_status import HelmRelease, NoJob, RecordedJobs, Status, ask_ray, ask_slurm


@dataclass(frozen=True)
class Step:
    """A command dskit suggests (`next: ...`), kept as its words until printed: `line` quotes each
    (dskit.io.text.command), so the line pasted into a shell runs exactly these words, whatever a run
    directory or a storage path holds (`$(...)`, quotes, spaces)."""

    label: str  # next, or, then
    words: tuple[str | Path, ...]

    def line(self) -> str:
        return f"{self.label}: {command(self.words)}"


@dataclass(frozen=True)
class Target:
    name: str
    help: str  # one line for `dskit render --help`
    #: the run directory's files (relative path -> text); `out_dir` is where they will live
    render: Callable[[Plan, Path], dict[str, str]]
    executable: tuple[str, ...]  # relative paths written with mode 0755
    #: how its job is submitted: what to run next, given the plan, the run directory and its files
    next_steps: Callable[[Plan, Path, dict[str, str]], list[Step]]
    #: how `dskit status RUN_DIR` finds and describes its job (dskit/status/run_status.py)
    status: Status
    #: directories the run writes besides the plan's checkpoint and output dirs (-o must not hold them)
    writes: Callable[[Plan], list[str]] = lambda plan: []
    #: a file only its run dirs hold: names the target of one rendered before TARGET_FILE existed
    sign: str | None = None

    def files(self, plan: Plan, out_dir: Path) -> dict[str, str]:
        """What `dskit render` writes: the target's files and TARGET_FILE naming the target, which
        `dskit status RUN_DIR` reads to know which scheduler to ask."""
        return {**self.render(plan, out_dir), TARGET_FILE: f"{self.name}\n"}


def _slurm_next(plan: Plan, out: Path, files: dict[str, str]) -> list[Step]:
    # submit.sh (sbatch, or a chain of jobs) records the job ids for `dskit status`; a plain
    # `sbatch job.sbatch` is recorded once the job starts
    return [Step("next", ("bash", out / slurm.SUBMIT)), Step("then", ("dskit", "status", out))]


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "slurm",
            "job.sbatch + submit.sh (`sbatch`, recording the job id)",
            slurm.render,
            (slurm.SCRIPT, slurm.SUBMIT),
            _slurm_next,
            RecordedJobs(
                ask_slurm, slurm.SUBMIT, "a job submitted with plain sbatch is recorded when it starts"
            ),
            sign=slurm.SCRIPT,
        ),
        Target(
            "helm",
            "values.yaml + chart for `helm install`",
            helm.render,
            (),
            lambda plan, out, files: [
                Step("next", ("helm", "install", plan.name, out / helm.CHART, "-f", out / helm.VALUES))
            ],
            HelmRelease(),
            sign=helm.VALUES,
        ),
        Target(
            "ray",
            "a job for `ray job submit` (+ KubeRay RayJob)",
            ray.render,
            (ray.SUBMIT,),
            lambda plan, out, files: [
                Step("next", ("bash", out / ray.SUBMIT)),  # ray job submit
                Step("or", ("kubectl", "apply", "-f", out / ray.RAYJOB)),  # KubeRay
            ],
            RecordedJobs(
                ask_ray,
                ray.SUBMIT,
                "a KubeRay RayJob applied with kubectl is not recorded: kubectl get rayjob",
                takes_address=True,
            ),
            writes=lambda plan: [plan.ray.storage_path],  # Ray Train's checkpoints and results
            sign=ray.RUNTIME_ENV,
        ),
        Target(
            "image",
            "Dockerfile + install script + lock for the GPU",
            image.render,
            (image.INSTALL, image.ENROOT),
            lambda plan, out, files: [
                Step(
                    "next", ("docker", "build", "-f", out / image.DOCKERFILE, "-t", image.plan_tag(plan), ".")
                )
            ],
            NoJob(),
        ),
    )
}
