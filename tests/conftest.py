"""Shared test helpers: run the real `dskit` CLI, render plans, and launch the real trainer on CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# groups, order, timeouts and the cost record of `make test` (the file says how and why)
pytest_plugins = ["tests.support.scheduling"]

#: a resharded resume against the uninterrupted run: the batch cut into other micro-steps and reduced in
#: another order. Measured on these tests within 2e-5 (and 2e-4 between fresh 1- and 2-rank runs);
#: resumed without the Adam moments the curve is off by 7e-3 one step later, with DeepSpeed's shared
#: step counter (checkpoint.py `_unshare_steps`) by 2e-3 two steps later.
RESHARD_RTOL = 2e-4

# The CPU training setup every trainer test uses: tiny model, 2 ranks, EP=2, ZeRO-3 on gloo.
TINY_SETS = [
    "training.seq_len=128",
    "training.global_batch=8",
    "training.lr=3e-3",
    "training.log_every=1",
]


def dskit(
    *args: str, cwd: Path | None = None, env: dict | None = None, check: bool = False, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (exit codes and stderr are part of the contract). A test of what a
    command decides and prints, not of its process, runs its main in the test's: tests/support/cli.py."""
    proc = subprocess.run(
        [sys.executable, "-m", "dskit", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"dskit {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def status_table(text: str) -> dict[str, str]:
    """`dskit status RUN_DIR`'s table as rows: a key, two or more spaces, the value."""
    return dict(re.split(r"  +", line, maxsplit=1) for line in text.splitlines())


def dskit_status(run_dir: Path, env: dict | None = None) -> dict[str, str]:
    """`dskit status RUN_DIR` against a real scheduler; its rows (it must answer, exit 0)."""
    return status_table(dskit("status", str(run_dir), env=env, check=True, timeout=120).stdout)


def render_tiny(
    tmp: Path,
    model: str | None = "tiny-v2",
    *,
    steps: int = 40,
    extra: list[str] | None = None,
    name: str = "run",
    target: str = "slurm",
    nodes: int = 1,
    gpus_per_node: int = 2,
    flags: list[str] | tuple[str, ...] = (),
    command: str = "render",
) -> Path:
    """Render a run dir for a tiny CPU plan with storage under `tmp`; returns the run dir. Jobs run the
    trainer with this test's interpreter (Slurm: runtime none; Ray: the entrypoint's python). With
    `model=None` the model comes from `extra` (e.g. `model.path=DIR`). `command`: `calibrate` renders
    the same plan's calibration job (`dskit calibrate TARGET`)."""
    out = tmp / name
    sets = [
        *TINY_SETS,
        f"training.steps={steps}",
        f"storage.root={tmp / 'storage'}",
        f"runtime.python={sys.executable}",
        *(extra or []),
    ]
    args = [
        command,
        target,
        "--gpu",
        "cpu",
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        str(gpus_per_node),
        *(["--model", model] if model else []),
        "--job-name",
        name,
        "-o",
        str(out),
        *flags,
    ]
    if target == "slurm":
        args += ["--runtime", "none"]
    for s in sets:
        args += ["--set", s]
    from tests.support.cli import cli  # a render's process is no part of what these tests check

    cli(*args, check=True)
    return out


@pytest.fixture
def repo() -> Path:
    return REPO


def slurm_launch(script: str, cwd: Path) -> tuple[dict[str, str], list[str]]:
    """What a rendered job.sbatch exports (its launch-contract block) and the command each node runs
    (its `launch` array), obtained by running the script's own lines in bash, with stand-in Slurm
    values for the first node and the job id."""
    from dskit.render import slurm

    block = script.split(slurm.ENV_BEGIN)[1].split(slurm.ENV_END)[0]
    launch = script[script.index("launch=(") : script.index("\n)\n") + 3]
    # env -0 ends every NAME=VALUE with NUL; one more NUL (an empty entry, which env never prints)
    # separates it from the argv, so no value can be mistaken for the separator.
    probe = f"{block}\nMASTER_ADDR=node1 MASTER_PORT=29500 SLURM_JOB_ID=7\n{launch}\nenv -0\nprintf '\\0'\n"
    probe += 'printf "%s\\0" "${launch[@]}"\n'
    out = subprocess.run(
        ["bash", "-euc", probe], capture_output=True, env={"PATH": os.environ["PATH"]}, cwd=cwd
    )
    assert out.returncode == 0, out.stderr
    env_part, argv_part = out.stdout.decode().split("\0\0", 1)
    env = dict(kv.split("=", 1) for kv in env_part.split("\0") if "=" in kv)
    return env, argv_part.split("\0")[:-1]


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size, mounted for the test and removed after it."""
    mounts: list[Path] = []

    def make(size_bytes: int) -> Path:
        d = tmp_path / f"disk{len(mounts)}"
        d.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(d)], capture_output=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounts.append(d)
        return d

    yield make
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], check=False)


def pytest_configure(config):
    """Every process the tests start (their own DeepSpeed engines, clusters, scripts) builds with this
    venv's ninja, as the trainer does (dskit/host/jit_ops.py): a second ninja on the same cache rebuilds
    every op, minutes each, inside some test's deadline."""
    from dskit.host.jit_ops import use_own_builds

    use_own_builds()


@pytest.fixture(scope="session")
def _extensions_root() -> Path:
    """torch's JIT extension cache under the suite's own environment (before any test changes it)."""
    from dskit.host.build_locks import extensions_root

    return extensions_root()


def _remove_orphaned_locks(root: Path, when: str) -> None:
    """Remove the build locks no process holds, seen so twice a second apart with the same inode: a lock
    between a live build's close and its own removal, or created anew meanwhile, is left alone."""
    from dskit.host.build_locks import orphaned

    first = {lock: lock.stat().st_ino for lock in orphaned(root) if lock.exists()}
    if not first:
        return
    time.sleep(1.0)
    for lock in orphaned(root):
        try:
            if first.get(lock) == lock.stat().st_ino:
                lock.unlink()
                warnings.warn(f"{when}: {lock} (a JIT build or load killed midway); removed", stacklevel=2)
        except FileNotFoundError:
            continue


@pytest.fixture(autouse=True)
def _no_orphaned_build_lock(request, _extensions_root):
    """A test that kills ranks (a fault, a timeout, a cluster's teardown) while one loads a JIT op leaves
    torch's build lock, and every later trainer start in the suite then waits on it forever: one test's
    kill would become every later test's timeout. The lock is the test's debris, like its namespaces:
    removed after it, with a warning naming the test (and before it, where an earlier run left one)."""
    _remove_orphaned_locks(_extensions_root, f"before {request.node.nodeid}")
    yield
    _remove_orphaned_locks(_extensions_root, f"{request.node.nodeid} left")


#: tests whose trainings may start ranks: the zygotes start where a run collects one of these
_TRAINS = ("train", "slow")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Local trainings' ranks fork from preloaded interpreters (tests/support/warm_ranks.py says how,
    and where they start cold instead). Started as collection ends, so their imports overlap the first
    tests (never an `alone` one); not for a run without trainings (the fast tier), nor with DSKIT_TEST_COLD_RANKS=1."""
    if os.environ.get("DSKIT_TEST_COLD_RANKS") == "1" or not any(
        item.get_closest_marker(m) for item in session.items for m in _TRAINS
    ):
        return
    import shutil
    import tempfile

    import yaml
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from tests.support.scheduling import busy_until
    from tests.support.warm_ranks import Session

    cache_dir()  # puts its default into os.environ, as any compile in this process would mid-run
    root = Path(tempfile.mkdtemp(prefix="dskit-warm-"))
    plan_env = yaml.safe_load((render_tiny(root / "plan") / "run.yaml").read_text())["env"]
    warm = Session(root / "ranks")
    warm.start({**os.environ, **{k: str(v) for k, v in plan_env.items()}})
    os.environ["PYTHON_EXEC"] = str(warm.shim)
    # their imports (two interpreters, both cores for seconds) must not run under an `alone` test's
    # measurements: a calibration taken meanwhile predicted 0.35x the tokens/s its trainings then ran at
    busy_until(session.config, warm.wait_ready)

    def stop() -> None:
        os.environ.pop("PYTHON_EXEC", None)
        summary = warm.summary()
        warm.stop()
        if cost := session.config.getoption("suite_cost"):  # beside the run's cost record
            out = Path(cost).parent / f"warm-ranks-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
            shutil.copyfile(warm.root / "zygotes.log", out.with_suffix(".log"))
        shutil.rmtree(root, ignore_errors=True)

    session.config.add_cleanup(stop)
