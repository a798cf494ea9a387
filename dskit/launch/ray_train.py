"""`python -m dskit.launch.ray_train`: the dskit trainer under Ray Train (the `ray job submit` entrypoint).

The driver builds a TorchTrainer from run.yaml; each worker runs the same `dskit.train.entry.run` as
torchrun ranks do, on the process group Ray Train set up. Checkpoints live where every target keeps
them (the plan's checkpoint dir on shared storage): when a worker dies or its watchdog finds a rank
hung, the driver starts a new worker group (up to ray.max_failures times; a stop on request does not
count) and it resumes from the newest verified checkpoint there.

The driver, not Ray's FailurePolicy, retries: Ray retries every worker error alike, but bad input
(exit 2) and a full checkpoint disk (74) fail the same way every time. Those end the job at once with
the worker's one-line reason as the driver's last line (`dskit status` shows it) and its exit code.
Workers report metrics and the latest checkpoint path through `ray.train.report`; the checkpoint
itself is not copied into Ray's storage (for a V3-sized model that copy would be terabytes).
"""

from __future__ import annotations

import os
import sys

from dskit.errors import EXIT_BAD_INPUT, RankExit, SpecError
from dskit.launch import env_vars
from dskit.launch.contract import EXIT_DISK_FULL, EXIT_REQUEUE, Env, collective_timeout_s

#: exit codes a retry cannot fix: the driver stops at the first
FINAL = (EXIT_BAD_INPUT, EXIT_DISK_FULL)


def _worker(config: dict) -> None:
    import ray.train

    from dskit.train.checkpoints.reshard import ConversionFailed
    from dskit.train.checkpoints.store import DiskFull

    os.environ[Env.RUN_FILE.value] = config["run_file"]
    ctx = ray.train.get_context()
    from dskit.train.entry import read_contract, run, setup_logging

    setup_logging(ctx.get_world_rank())
    try:
        plan, data, sampler, eval_sampler = read_contract(launcher_env=False)
        if ctx.get_world_size() != plan.hardware.world_size:
            raise RuntimeError(
                f"Ray started {ctx.get_world_size()} workers, the plan is for {plan.hardware.world_size}"
            )
        code = run(plan, data, sampler, eval_sampler, reporter=lambda rec: ray.train.report(rec))
    except SpecError as e:
        raise RankExit(EXIT_BAD_INPUT, str(e)) from None
    except DiskFull as e:
        raise RankExit(e.code, str(e)) from None
    except ConversionFailed as e:  # a waiting rank's has no code: rank 0's own RankExit carries it
        raise RankExit(1 if e.code is None else e.code, str(e)) from None
    if code == EXIT_REQUEUE:
        raise RankExit(code, "stopped on request after a checkpoint; a new worker group resumes from it")
    if code != 0:
        raise RankExit(code, f"trainer exited with code {code}")


def rank_exits(error: BaseException) -> list[RankExit]:
    """The RankExits inside a failed fit(): Ray wraps a worker's exception (RayTaskError subclasses
    that also derive from the cause, `.cause`, `__cause__`) in a WorkerGroupError per rank."""
    found, seen = [], set()
    todo = [error, *getattr(error, "worker_failures", {}).values()]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RankExit):
            found.append(e)
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return found


def main() -> int:
    from dskit.train.entry import read_contract, setup_logging

    setup_logging(0)
    run_file = env_vars.read(Env.RUN_FILE.value)
    if run_file:  # relative to the job's working_dir: make it absolute before workers start elsewhere
        os.environ[Env.RUN_FILE.value] = os.path.abspath(run_file)
    try:
        plan, *_ = read_contract(launcher_env=False)
    except SpecError as e:
        print(f"dskit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    return _fit_with_retries(plan)


def _trainer(plan, attempt: int):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    hw = plan.hardware
    per_worker = (
        {"GPU": 1, "CPU": max(1, int(plan.env.get(Env.OMP_NUM_THREADS.value, "1")))}
        if hw.on_gpu
        else {"CPU": 1}
    )
    return TorchTrainer(
        _worker,
        train_loop_config={"run_file": env_vars.read(Env.RUN_FILE.value)},
        # collectives time out with the watchdog (dskit/plan/hang_timeout.py), as under torchrun
        torch_config=TorchConfig(
            backend="nccl" if hw.on_gpu else "gloo",
            timeout_s=int(collective_timeout_s(plan.run.watchdog_timeout_s)),
        ),
        scaling_config=ScalingConfig(
            num_workers=hw.world_size, use_gpu=hw.on_gpu, resources_per_worker=per_worker
        ),
        run_config=RunConfig(
            name=plan.name if attempt == 1 else f"{plan.name}-attempt{attempt}",
            storage_path=plan.ray.storage_path,
            failure_config=FailureConfig(max_failures=0),  # the driver retries (module docstring)
        ),
    )


def _fit_with_retries(plan) -> int:
    from ray.train import TrainingFailedError

    limit = plan.ray.max_failures
    failures, attempt = 0, 0
    while True:
        attempt += 1
        try:
            _trainer(plan, attempt).fit()
            break
        except TrainingFailedError as e:  # the workers failed; anything else is the driver's own error
            exits = rank_exits(e)
            final = next((x for x in exits if x.code in FINAL), None)
            if final is not None:
                sys.stderr.write(f"dskit: error: {final.message}\n")
                return final.code
            requested = bool(exits) and all(x.code == EXIT_REQUEUE for x in exits)
            if not requested:
                failures += 1
            why = exits[0].message if exits else (str(e).strip().splitlines() or [type(e).__name__])[-1]
            if not requested and failures > limit:
                sys.stderr.write(f"dskit: ray training failed after {failures} failure(s): {why[:300]}\n")
                return 1
            print(
                f"dskit: attempt {attempt} ended ({why[:300]}); {'' if requested else f'failure {failures}, '}"
                "starting a new worker group from the newest checkpoint",
                flush=True,
            )
    print(
        f"dskit: ray training finished ({plan.optim.steps} steps, checkpoints in {plan.run.checkpoint_dir})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
