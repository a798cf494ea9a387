"""The one torchrun command line that starts the trainer: on a cluster node (Slurm task, Kubernetes pod)
with a c10d rendezvous, or standalone on this machine (`dskit train --local`).

Failed ranks are not restarted in place (--max-restarts=0): the scheduler restarts the whole job,
which resumes from the last checkpoint; locally the user does.

`python -m dskit.launch.torchrun ARGS` is torchrun itself (its launcher agent, in this process, same
arguments, same exit status) minus its traceback: when ranks fail, torchrun raises ChildFailedError
and prints a page of stack for what is often a requested stop (exit 75) or a configuration error the
rank already explained in one line. Here each failed rank is one line instead.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading

TRAINER_MODULE = "dskit.train"
LAUNCHER_MODULE = "dskit.launch.torchrun"


def torchrun_words(
    python: str,
    *,
    nproc_per_node: int,
    nodes: int | None = None,
    endpoint: str | None = None,
    rdzv_id: str | None = None,
) -> list[str]:
    """`python -m dskit.launch.torchrun ... -m dskit.train`. With `endpoint` (and `nodes`, `rdzv_id`):
    a c10d rendezvous across nodes; without: --standalone on one machine. Words arrive in the caller's
    syntax (quoted for a shell, $(VAR) for Kubernetes): nothing is quoted here."""
    words = [python, "-m", LAUNCHER_MODULE]
    if endpoint is None:
        words.append("--standalone")
    else:
        words.append(f"--nnodes={nodes}")
    words.append(f"--nproc-per-node={nproc_per_node}")
    if endpoint is not None:
        words += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
    return [*words, "--max-restarts=0", "-m", TRAINER_MODULE]


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except SignalException as e:  # torchrun stopped its workers first (srun ending the step, a kill)
        sys.stderr.write(f"dskit: torchrun on {socket.gethostname()} stopped by {signal_name(e.sigval)}\n")
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        for rank, f in sorted(e.failures.items()):
            how = f"killed by {signal_name(-f.exitcode)}" if f.exitcode < 0 else f"exited with {f.exitcode}"
            sys.stderr.write(f"dskit: rank {rank} (pid {f.pid} on {socket.gethostname()}) {how}\n")
        return 1  # torchrun's own status for failed workers
    return 0


def exit_without_teardown(code: int) -> None:
    """End this process as the interpreter would, minus freeing every module: wait for the threads that
    are not daemons, run the exit handlers (trackers, logging), flush, then os._exit. Freeing what
    torch, DeepSpeed and transformers loaded took 1.2 s of each trainer rank's exit and 0.3 s of
    torchrun's on 2 cores, at every launch and restart, after the work was done."""
    # What the interpreter's own finalization calls first: the hooks that tell pool workers to leave
    # (concurrent.futures registers one: inductor's compile pool would otherwise wait on its queue for
    # ever, as every idle ThreadPoolExecutor worker does), then a join of the threads that are not daemons.
    threading._shutdown()  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001 (what the interpreter would run at exit, in its order)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


if __name__ == "__main__":
    exit_without_teardown(main())
