"""`python -m dskit.ray_train`: the dskit trainer under Ray Train (the `ray job submit` entrypoint).

The driver builds a TorchTrainer from run.yaml; each worker runs the same `dskit.train.entry.run` as
torchrun ranks do, on the process group Ray Train set up. Checkpoints live where every target keeps
them (the plan's checkpoint dir on shared storage): when a worker dies, Ray restarts the worker group
(FailureConfig.max_failures) and the new group resumes from the newest verified checkpoint there.
Workers report metrics and the latest checkpoint path through `ray.train.report`; the checkpoint
itself is not copied into Ray's storage (for a V3-sized model that copy would be terabytes).
"""

from __future__ import annotations

import os
import sys

from dskit.contract import EXIT_REQUEUE, Env
from dskit.errors import EXIT_BAD_INPUT, SpecError


def _worker(config: dict) -> None:
    import ray.train

    os.environ[Env.RUN_FILE.value] = config["run_file"]
    ctx = ray.train.get_context()
    from dskit.train.entry import read_contract, run, setup_logging

    setup_logging(ctx.get_world_rank())
    plan, data, sampler, eval_sampler = read_contract(launcher_env=False)
    if ctx.get_world_size() != plan.hardware.world_size:
        raise RuntimeError(
            f"Ray started {ctx.get_world_size()} workers, the plan is for {plan.hardware.world_size}"
        )
    code = run(plan, data, sampler, eval_sampler, reporter=lambda rec: ray.train.report(rec))
    if code == EXIT_REQUEUE:
        raise RuntimeError("stopped on request after a checkpoint; a restarted worker group resumes from it")
    if code != 0:
        raise RuntimeError(f"trainer exited with code {code}")


def main() -> int:
    from dskit.train.entry import read_contract, setup_logging

    setup_logging(0)
    run_file = os.environ.get(Env.RUN_FILE.value)
    if run_file:  # relative to the job's working_dir: make it absolute before workers start elsewhere
        os.environ[Env.RUN_FILE.value] = os.path.abspath(run_file)
    try:
        plan, *_ = read_contract(launcher_env=False)
    except SpecError as e:
        print(f"dskit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    hw = plan.hardware
    per_worker = (
        {"GPU": 1, "CPU": max(1, int(plan.env.get(Env.OMP_NUM_THREADS.value, "1")))}
        if hw.on_gpu
        else {"CPU": 1}
    )
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"run_file": os.environ[Env.RUN_FILE.value]},
        torch_config=TorchConfig(backend="nccl" if hw.on_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=hw.world_size, use_gpu=hw.on_gpu, resources_per_worker=per_worker
        ),
        run_config=RunConfig(
            name=plan.name,
            storage_path=plan.ray.storage_path,
            failure_config=FailureConfig(max_failures=plan.ray.max_failures),
        ),
    )
    result = trainer.fit()
    if result.error:
        print(f"dskit: ray training failed: {result.error}", file=sys.stderr)
        return 1
    print(
        f"dskit: ray training finished ({plan.optim.steps} steps, checkpoints in {plan.run.checkpoint_dir})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
