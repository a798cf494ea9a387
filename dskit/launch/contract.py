"""The launch contract: names shared by the renderers (writers) and the trainer (reader).

Every target (Slurm, Helm, Ray) exports the same `Env` names with the same values for the same plan;
only RUN_FILE's path differs, because each target mounts run.yaml its own way (the file's content is
identical). tests/render/test_helm.py (test_pod_env_command_and_rendezvous_equal_the_slurm_and_ray_renders)
renders every target and diffs them.

Process identity (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) comes from
the launcher (torchrun, Ray Train), never from dskit.
"""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path

from dskit.errors import EXIT_BAD_INPUT, SpecError
from dskit.io.text import escape
from dskit.launch import env_vars


class Env(str, Enum):
    RUN_FILE = "DSKIT_RUN_FILE"  # path of run.yaml: the trainer's only input
    GPU_PROFILE = "DSKIT_GPU_PROFILE"  # catalog name; the trainer checks it against run.yaml
    CHECKPOINT_DIR = "DSKIT_CHECKPOINT_DIR"
    OUTPUT_DIR = "DSKIT_OUTPUT_DIR"
    SHM_BYTES = "DSKIT_SHM_BYTES"  # /dev/shm size the target provisioned; `dskit doctor` compares
    CUDA_DEVICE_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
    PYTORCH_CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
    OMP_NUM_THREADS = "OMP_NUM_THREADS"


#: Names every target must export (fabric NCCL_* names come on top, from the catalog).
REQUIRED = tuple(e.value for e in Env)

#: Process env set by the launcher, read by the trainer.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: Set by every launcher that runs torchrun (`dskit train --local`, Slurm's job.sbatch, the pods'
#: launch.sh): a directory for the ranks' own exit codes. torchrun reports every worker failure as 1, so
#: each rank that ends with a non-zero code writes it to DIR/rank{RANK}, and the launcher decides from
#: them (`exit_verdict`): 2 fails for good, 74 too, 75 on every rank that wrote is a requeue. Slurm's
#: directory is on the shared output dir (ranks of every node write there); the others are local.
EXIT_DIR_ENV = "DSKIT_EXIT_DIR"

#: Names no user setting (kubernetes.secret_env) may set: the contract's own, the launcher's, and any
#: DSKIT_* name (the chart sets DSKIT_RDZV_ID and DSKIT_EXIT_DIR). The plan's env adds its names on top.
RESERVED_ENV = frozenset((*REQUIRED, *LAUNCHER_ENV, EXIT_DIR_ENV))
RESERVED_ENV_PREFIX = "DSKIT_"

#: The trainer exits with this code after a signal-triggered checkpoint, and when its watchdog finds a
#: rank hung (dskit/train/watchdog.py): "requeue me". 75 is EX_TEMPFAIL (sysexits.h): a temporary
#: failure, retry later. Slurm's batch script requeues on it, the Helm chart's podFailurePolicy restarts
#: on it, the Ray driver starts a new worker group.
EXIT_REQUEUE = 75
#: A checkpoint save found the disk full (ENOSPC, EDQUOT): the previous checkpoint is intact, the
#: partial one removed. 74 is EX_IOERR (sysexits.h). Not retried on any target: a retry would fill the
#: same disk again; free space (or point storage.checkpoint_dir elsewhere) and resubmit.
EXIT_DISK_FULL = 74


def exit_verdict(codes: set[int]) -> int | None:
    """What a launcher exits with, from the codes its ranks wrote (EXIT_DIR_ENV); None: no verdict,
    use torchrun's own status. Bad input wins (no retry can fix it), then a full disk, then a requeue
    when every rank that wrote asked for one (a rank that crashed otherwise makes it a failure)."""
    for code in (EXIT_BAD_INPUT, EXIT_DISK_FULL):
        if code in codes:
            return code
    if codes == {EXIT_REQUEUE}:
        return EXIT_REQUEUE
    return None


def read_exit_codes(directory: Path) -> set[int]:
    """The codes ranks wrote with record_exit (unreadable entries are left out)."""
    codes = set()
    for p in directory.glob("rank*") if directory.is_dir() else ():
        try:
            codes.add(int(p.read_text().strip()))
        except (OSError, ValueError):
            continue
    return codes


#: what charts rendered by dskit before DSKIT_EXIT_DIR set (their pods' launch.sh read it); their runs
#: may still be restarted by their Jobs with this trainer
LEGACY_EXIT_FILE_ENV = "DSKIT_EXIT_FILE"


def record_exit(code: int) -> int:
    """Tell a supervising launcher this rank's exit code (see contract.EXIT_DIR_ENV)."""
    directory = env_vars.read(EXIT_DIR_ENV)
    if code and directory:
        # one file per rank, written whole: ranks of several nodes may share the directory (NFS appends
        # from two clients can overwrite each other); a second call (watchdog after an error) overwrites
        rank = _rank_or_pid()
        try:
            tmp = Path(directory, f".rank{rank}.tmp")
            tmp.write_text(f"{code}\n")
            os.replace(tmp, Path(directory, f"rank{rank}"))
        except OSError as e:  # the code still reaches torchrun; the launcher then cannot tell 75 from 1
            sys.stderr.write(
                escape(f"dskit: warning: cannot record exit code {code} in {directory}: {e}") + "\n"
            )
    legacy = env_vars.read(LEGACY_EXIT_FILE_ENV)
    if code and legacy:  # a pod of a chart rendered before DSKIT_EXIT_DIR: its launch.sh reads this file
        try:
            with open(legacy, "a") as f:  # O_APPEND: one short line per rank of the pod
                f.write(f"{code}\n")
        except OSError:
            pass
    return code


def _rank_or_pid() -> str:
    """This rank's number, or the process id where the launcher set none. A RANK that does not parse
    was refused at the rank's start (exit 2), which this then records: under the process id."""
    try:
        rank = env_vars.read("RANK")
    except SpecError:
        rank = None
    return str(os.getpid() if rank is None else rank)


#: How much later than the watchdog a collective times out: more than the watchdog's polling interval
#: (at most 5 s) and the time it takes to write its report.
COLLECTIVE_GRACE_S = 60.0


def collective_timeout_s(watchdog_timeout_s: float) -> float:
    return watchdog_timeout_s + COLLECTIVE_GRACE_S


# The names of the files and directories a run writes and reads, one place for every writer and reader
# (renderers, the trainer, `dskit status`, `dskit report`, `dskit calibrate`).

#: File names inside a rendered run directory.
RUN_YAML = "run.yaml"
#: `dskit train --local`'s record of who runs the run directory (dskit/launch/local_run.py)
LOCAL_RUN_FILE = "local-run.json"
#: Where Kubernetes pods (the Helm chart, KubeRay) mount the run's ConfigMap; run.yaml is inside it.
K8S_CONFIG_MOUNT = "/etc/dskit"
DEEPSPEED_JSON = "deepspeed.json"
#: The target a run directory was rendered for (one line: slurm, helm, ray, image): `dskit status` asks
#: that target's scheduler.
TARGET_FILE = "target"
#: The jobs submitted from a run directory, one per line, appended by the rendered scripts with one
#: write each (Slurm: `JOBID` by submit.sh and by job.sbatch when it starts; Ray: `SUBMISSION_ID ADDRESS`
#: by submit.sh). `dskit status` reads it.
JOBS_FILE = "jobs"

#: Stop request: a launcher that cannot signal the ranks directly (torchrun does not forward SIGUSR1,
#: and containers hide PIDs) creates this file in the checkpoint dir; the trainer polls it each step,
#: checkpoints, deletes it and exits with EXIT_REQUEUE. Launchers delete a stale one before starting.
STOP_FILE = "STOP"
#: Written in the output dir when all steps are done, so launchers do not requeue a finished run.
COMPLETE_FILE = "COMPLETE"

#: The storage root's defaults, under ROOT/NAME (storage.checkpoint_dir and storage.output_dir unset).
CHECKPOINTS_DIR = "checkpoints"
OUTPUTS_DIR = "outputs"

#: Files in the output dir. Rank 0 appends one training record per log step to METRICS_FILE and one
#: eval record per eval to EVAL_FILE (dskit/train/metrics.py); `dskit status`, `dskit report` and
#: `dskit calibrate --candidates` read them back.
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
#: what rank 0 saw of the contract (dskit/train/entry.py); `dskit report` shows it
LAUNCH_ENV_FILE = "launch-env.json"
#: training.profile_steps' table and Chrome trace (dskit/train/profile.py)
PROFILE_FILE = "profile.json"
PROFILE_TRACE_FILE = "profile-trace.json"
#: what a calibration job's rank 0 writes in its output dir (dskit/calibrate/job.py), handed to
#: hardware.calibration
CALIBRATION_FILE = "calibration.json"
