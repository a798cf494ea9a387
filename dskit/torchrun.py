"""The one torchrun command line that starts the trainer: on a cluster node (Slurm task, Kubernetes pod)
with a c10d rendezvous, or standalone on this machine (`dskit train --local`).

Failed ranks are not restarted in place (--max-restarts=0): the scheduler restarts the whole job,
which resumes from the last checkpoint; locally the user does.
"""

from __future__ import annotations

TRAINER_MODULE = "dskit.train"


def torchrun_words(
    python: str,
    *,
    nproc_per_node: int,
    nodes: int | None = None,
    endpoint: str | None = None,
    rdzv_id: str | None = None,
) -> list[str]:
    """`python -m torch.distributed.run ... -m dskit.train`. With `endpoint` (and `nodes`, `rdzv_id`):
    a c10d rendezvous across nodes; without: --standalone on one machine. Words arrive in the caller's
    syntax (quoted for a shell, $(VAR) for Kubernetes): nothing is quoted here."""
    words = [python, "-m", "torch.distributed.run"]
    if endpoint is None:
        words.append("--standalone")
    else:
        words.append(f"--nnodes={nodes}")
    words.append(f"--nproc-per-node={nproc_per_node}")
    if endpoint is not None:
        words += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
    return [*words, "--max-restarts=0", "-m", TRAINER_MODULE]
