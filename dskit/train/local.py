"""`dskit train --local`: run a rendered plan under torchrun on this machine (CPU demo, debugging).

The same entry point and the same launch contract as the cluster targets: the env comes from run.yaml.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from dskit.errors import SpecError
from dskit.launch import local_run
from dskit.launch.contract import EXIT_DIR_ENV, RUN_YAML, STOP_FILE, Env, exit_verdict, read_exit_codes
from dskit.launch.torchrun import torchrun_words


def run_file_of(run: str | None) -> Path:
    if not run:
        raise SpecError("run", "give a run directory (from `dskit render`) or its run.yaml")
    p = Path(run)
    f = p / RUN_YAML if p.is_dir() else p
    if not f.is_file():
        raise SpecError("run", f"{f} not found; render one with `dskit render slurm ... -o DIR`")
    return f.resolve()


def check_host_gpus(gpu: str, world: int) -> None:
    """A run started on this host needs its GPUs here: one line naming hardware.gpu, before anything is
    written or spawned (else each of `world` ranks died in torch.cuda.set_device with its own traceback)."""
    from dskit import catalog

    if catalog.gpu(gpu).is_cpu:
        return
    import torch

    have = torch.cuda.device_count()
    if have < world:
        here = f"{have} GPU{'s' * (have != 1)}" if have else "no GPU"
        raise SpecError(
            "hardware.gpu",
            f"{gpu}: this run starts {world} ranks on this host, which has {here}; plan it for this host "
            f"(hardware.gpu cpu{f', or hardware.gpus_per_node {have}' if have else ''})",
        )


def run_local(run: str | None, *, nproc: int | None = None) -> int:
    from dskit.plan.schema import load_plan

    run_file = run_file_of(run)
    plan = load_plan(run_file)
    world = plan.hardware.world_size
    if nproc is not None and nproc != world:
        raise SpecError(
            "--nproc",
            f"{nproc} processes, but the plan is for world size {world}: pass --nproc {world} "
            "or re-render with --nodes 1 --gpus-per-node N",
        )
    check_host_gpus(plan.hardware.gpu, world)
    local_run.refuse_while_trained(
        run_file.parent, "a second trainer would write its checkpoints and metrics under it"
    )
    stop = Path(plan.run.checkpoint_dir, STOP_FILE)
    stop.unlink(missing_ok=True)  # a stale request would stop us at once
    env = {**os.environ, **plan.env, Env.RUN_FILE.value: str(run_file)}
    cmd = torchrun_words(sys.executable, nproc_per_node=world)
    print("+ " + " ".join(cmd), flush=True)
    record = local_run.start(run_file.parent)  # what `dskit status RUN_DIR` reads of a run started here
    try:
        code = _torchrun(cmd, env, stop)
    except BaseException as e:
        local_run.end(record, None, interrupted=type(e).__name__)
        raise
    local_run.end(record, code)
    return code


def _torchrun(cmd: list[str], env: dict[str, str], stop: Path) -> int:
    """torchrun's run of the ranks, with their own exit codes relayed (`relayed_exit`)."""
    with tempfile.TemporaryDirectory(prefix="dskit-local-") as tmp:
        exit_dir = Path(tmp, "exit-codes")
        exit_dir.mkdir()
        with _stop_requests_to(stop) as requests:
            requests.child = subprocess.Popen(cmd, env={**env, EXIT_DIR_ENV: str(exit_dir)})
            try:
                status = requests.child.wait()
            except BaseException:  # never leave torchrun running without its launcher
                requests.child.terminate()
                requests.child.wait()
                raise
        return relayed_exit(status, exit_dir)


class _stop_requests_to:
    """USR1/TERM to this launcher become the STOP file, as the Slurm batch script's trap does: torchrun
    does not forward USR1 (and would kill the ranks on TERM before they checkpoint), so the request
    reaches every rank at its next step, they checkpoint and exit 75, and the same command resumes.
    A second TERM, or a STOP file that cannot be written, stops torchrun itself (no checkpoint)."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, stop: Path):
        self.stop = stop
        self.previous: dict[int, object] = {}
        self.child: subprocess.Popen | None = None
        self.asked = False

    def _say(self, text: str) -> None:
        os.write(2, f"dskit: {text}\n".encode())  # not print(): a handler may interrupt a print

    def _request(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM and self.asked and self.child is not None:
            self._say(f"{name} again; stopping torchrun without a checkpoint")
            self.child.terminate()
            return
        self.asked = True
        self._say(f"{name} received; asking ranks to checkpoint")
        try:
            self.stop.parent.mkdir(parents=True, exist_ok=True)
            self.stop.touch()
        except OSError as e:
            self._say(f"cannot write {self.stop} ({e.strerror or e}); stopping torchrun without a checkpoint")
            if self.child is not None:
                self.child.terminate()

    def __enter__(self) -> _stop_requests_to:
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._request)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def relayed_exit(status: int, exit_dir: Path) -> int:
    """torchrun reports any failed rank as exit 1; the ranks' own codes (contract.EXIT_DIR_ENV) say
    whether it was bad input (2: do not retry), a full disk (74) or a requested stop or hung rank (75
    on every rank that wrote)."""
    verdict = exit_verdict(read_exit_codes(exit_dir))
    return status if verdict is None else verdict
