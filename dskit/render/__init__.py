"""Render targets: a plan -> the files of one run directory. Each target is one `Target` in `TARGETS`;
the CLI (`dskit render TARGET`) only iterates this registry, so adding a target is adding an entry here
(and its module beside this one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dskit.plan import Plan
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


def _slurm_next(plan: Plan, out: Path, files: dict[str, str]) -> str:
    if slurm.CHAIN_SCRIPT in files:
        return f"bash {out / slurm.CHAIN_SCRIPT}"
    return f"sbatch {out / slurm.SCRIPT}"


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "slurm",
            "job.sbatch for `sbatch`",
            slurm.render,
            (slurm.SCRIPT, slurm.CHAIN_SCRIPT),
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
