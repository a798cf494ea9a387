"""Slurm target: plan -> job.sbatch (one srun task per node, each running torchrun)."""

from __future__ import annotations

from pathlib import Path

from dskit import __version__
from dskit.errors import EXIT_BAD_INPUT, SpecError
from dskit.launch.contract import (
    COMPLETE_FILE,
    EXIT_DIR_ENV,
    EXIT_DISK_FULL,
    EXIT_REQUEUE,
    JOBS_FILE,
    RUN_YAML,
    STOP_FILE,
)
from dskit.plan.schema import Plan
from dskit.render.common import comment_block, env_lines, q, render_template, run_files, sq, torchrun_words

SCRIPT = "job.sbatch"
SUBMIT = "submit.sh"  # sbatch (a chain of N with slurm.chain), recording each job id in JOBS_FILE
#: Marker lines around the environment block; tests execute exactly this block.
ENV_BEGIN, ENV_END = "# >>> dskit launch contract", "# <<< dskit launch contract"


def _check_mounts(plan: Plan, run_dir: Path) -> None:
    """pyxis (--container-mounts) and apptainer (--bind) split mount lists at ',' and each mount at
    ':': a path with those characters would mount something else than it says, so refuse it."""
    la = plan.launch
    for field, path in (("storage.root", la.storage_root), ("--output", str(run_dir))):
        if "," in path or ":" in path:
            raise SpecError(
                field, f"{path!r} contains ',' or ':', which {la.runtime}'s mount list cannot carry"
            )
    for m in la.mounts:
        if "," in m:
            raise SpecError("runtime.mounts", f"{m!r} contains ',', which {la.runtime} reads as two mounts")


def _container_words(plan: Plan, run_dir: Path) -> list[str]:
    """srun options / wrapper that put the trainer inside the runtime, each already shell-quoted."""
    la = plan.launch
    if la.runtime != "none":
        _check_mounts(plan, run_dir)
    mounts = [f"{la.storage_root}:{la.storage_root}", f"{run_dir}:{run_dir}", *la.mounts]
    if la.runtime == "pyxis":
        return [
            q(f"--container-image={la.image}"),
            sq("--container-mounts=" + ",".join(mounts)),
            "--no-container-mount-home",
            q(f"--container-workdir={run_dir}"),
        ]
    if la.runtime == "apptainer":
        words = ["apptainer", "exec"]
        if plan.hardware.on_gpu:
            words.append("--nv")
        for m in mounts:
            words += ["--bind", q(m)]
        return words + [q(la.image)]
    return []


def launch_words(plan: Plan, run_dir: Path) -> list[str]:
    """The srun command line, one shell word per element. ${...} words expand at run time."""
    la, hw = plan.launch, plan.hardware
    srun = ["srun", "--ntasks-per-node=1", f"--nodes={hw.nodes}", "--kill-on-bad-exit=1"]
    container = _container_words(plan, run_dir)
    if la.runtime == "pyxis":
        srun += container
        container = []
    torchrun = torchrun_words(
        plan, quote=q, endpoint='"${MASTER_ADDR}:${MASTER_PORT}"', rdzv_id='"${SLURM_JOB_ID}"'
    )
    return srun + container + torchrun


def render(plan: Plan, run_dir: Path) -> dict[str, str]:
    """Files of a Slurm run directory. `run_dir` is where they will live (baked in as an absolute path)."""
    run_dir = Path(run_dir).resolve()
    s = plan.slurm
    directives = [f"--job-name={plan.name}", f"--nodes={plan.hardware.nodes}", "--ntasks-per-node=1"]
    if plan.hardware.on_gpu:
        directives.append(f"--gpus-per-node={plan.hardware.procs_per_node}")
    chain = s.chain
    directives += [
        "--exclusive",
        f"--time={s.time}",
        "--output=%x-%j.out",
        "--open-mode=append",
        f"--signal=B:USR1@{s.grace_seconds}",
        "--requeue",
    ]
    directives += [f"--{k}={v}" for k in ("partition", "account", "qos") if (v := getattr(s, k))]
    directives += s.extra_args
    env = env_lines({**plan.env})
    header = comment_block(
        f"Rendered by dskit {__version__}. Do not edit: change the run spec and re-render.",
        f"Plan: {plan.summary()}",
        *(f"WARNING: {w}" for w in plan.warnings),
    )
    script = render_template(
        "slurm/job.sbatch.j2",
        header=header,
        directives=directives,
        env_begin=ENV_BEGIN,
        env_end=ENV_END,
        run_dir=q(str(run_dir)),
        run_yaml=RUN_YAML,
        env=env,
        rdzv_port=plan.launch.rdzv_port,
        checkpoint_dir=q(plan.run.checkpoint_dir),
        stop_file=q(f"{plan.run.checkpoint_dir}/{STOP_FILE}"),
        complete_file=q(f"{plan.run.output_dir}/{COMPLETE_FILE}"),
        output_dir=q(plan.run.output_dir),
        jobs_file=JOBS_FILE,
        launch=launch_words(plan, run_dir),
        exit_requeue=EXIT_REQUEUE,
        exit_bad_input=EXIT_BAD_INPUT,
        exit_disk_full=EXIT_DISK_FULL,
        exit_dir_env=EXIT_DIR_ENV,
        requeue_on_stop=chain == 1,
        chain=chain,
    )
    submit = render_template(
        "slurm/submit.sh.j2",
        version=__version__,
        chain=chain,
        script=q(str(run_dir / SCRIPT)),
        jobs_file=q(str(run_dir / JOBS_FILE)),
    )
    return {**run_files(plan), SCRIPT: script, SUBMIT: submit}
