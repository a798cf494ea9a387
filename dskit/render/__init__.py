"""Render targets: a plan -> the files of one run directory. Each target is one `Target` in `TARGETS`;
the CLI (`dskit render TARGET`) only iterates this registry, so adding a target is adding an entry here
(and its module beside this one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dskit.contract import TARGET_FILE
from dskit.plan.schema import Plan
from dskit.render import helm, image, ray, slurm


@dataclass(frozen=True)
class Target:
    name: str
    help: str  # one line for `dskit render --help`
    #: the run directory's files (relative path -> text); `out_dir` is where they will live
    render: Callable[[Plan, Path], dict[str, str]]
    executable: tuple[str, ...]  # relative paths written with mode 0755
    #: what to run next, given the plan, the run directory and the files written there
    next_step: Callable[[Plan, Path, dict[str, str]], str]
    #: directories the run writes besides the plan's checkpoint and output dirs (-o must not hold them)
    writes: Callable[[Plan], list[str]] = lambda plan: []

    def files(self, plan: Plan, out_dir: Path) -> dict[str, str]:
        """What `dskit render` writes: the target's files and TARGET_FILE naming the target, which
        `dskit status RUN_DIR` reads to know which scheduler to ask."""
        return {**self.render(plan, out_dir), TARGET_FILE: f"{self.name}\n"}


def _slurm_next(plan: Plan, out: Path, files: dict[str, str]) -> str:
    # submit.sh records the job ids for `dskit status`; a plain `sbatch job.sbatch` is recorded once
    # the job starts
    what = f"a chain of {plan.slurm.chain} jobs" if plan.slurm.chain > 1 else f"sbatch {out / slurm.SCRIPT}"
    return f"bash {out / slurm.SUBMIT}   ({what}; `dskit status {out}` follows it)"


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "slurm",
            "job.sbatch + submit.sh (`sbatch`, recording the job id)",
            slurm.render,
            (slurm.SCRIPT, slurm.SUBMIT),
            _slurm_next,
        ),
        Target(
            "helm",
            "values.yaml + chart for `helm install`",
            helm.render,
            (),
            lambda plan, out, files: f"helm install {plan.name} {out / helm.CHART} -f {out / helm.VALUES}",
        ),
        Target(
            "ray",
            "a job for `ray job submit` (+ KubeRay RayJob)",
            ray.render,
            (ray.SUBMIT,),
            lambda plan, out, files: f"bash {out / ray.SUBMIT}   (or: kubectl apply -f {out / ray.RAYJOB})",
            writes=lambda plan: [plan.ray.storage_path],  # Ray Train's checkpoints and results
        ),
        Target(
            "image",
            "Dockerfile + install script + lock for the GPU",
            image.render,
            (image.INSTALL, image.ENROOT),
            lambda plan, out, files: f"docker build -f {out / image.DOCKERFILE} -t {image.plan_tag(plan)} .",
        ),
    )
}
