"""The launch contract: names shared by the renderers (writers) and the trainer (reader).

Every target (Slurm, Helm, Ray) exports the same `Env` names with the same values for the same plan;
only RUN_FILE's path differs, because each target mounts run.yaml its own way (the file's content is
identical). tests/test_helm.py (test_pod_env_command_and_rendezvous_equal_the_slurm_and_ray_renders)
renders every target and diffs them.

Process identity (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) comes from
the launcher (torchrun, Ray Train), never from dskit.
"""

from __future__ import annotations

from enum import Enum


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

#: Set by launchers that run torchrun under a supervisor which acts on exit codes (the Helm chart's pod
#: entrypoint). torchrun reports every worker failure as 1, so each rank that ends with a non-zero code
#: appends it here, one line per rank, and the launcher exits with it (75: restart, 2: fail for good).
EXIT_FILE_ENV = "DSKIT_EXIT_FILE"

#: Names no user setting (kubernetes.secret_env) may set: the contract's own, the launcher's, and any
#: DSKIT_* name (the chart sets DSKIT_RDZV_ID and DSKIT_EXIT_FILE). The plan's env adds its names on top.
RESERVED_ENV = frozenset((*REQUIRED, *LAUNCHER_ENV, EXIT_FILE_ENV))
RESERVED_ENV_PREFIX = "DSKIT_"

#: The trainer exits with this code after a signal-triggered checkpoint: "requeue me".
#: 75 is EX_TEMPFAIL (sysexits.h): a temporary failure, retry later. Slurm's batch script requeues on
#: it, the Helm chart's podFailurePolicy restarts on it, Ray counts it as a retryable worker failure.
EXIT_REQUEUE = 75

#: File names inside a rendered run directory.
RUN_YAML = "run.yaml"
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
