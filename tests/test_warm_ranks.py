"""The suite's warm ranks (tests/support/warm_ranks.py) are the trainer as torchrun would start it: the
shim's streams, exit status and signals reach the forked rank and back, and a rank whose environment
the zygote did not import under starts cold, saying why."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import render_tiny

pytestmark = pytest.mark.slow


@pytest.fixture
def shim() -> Path:
    exe = os.environ.get("PYTHON_EXEC")
    if os.environ.get("DSKIT_TEST_COLD_RANKS") == "1":
        pytest.skip("DSKIT_TEST_COLD_RANKS=1: this run starts every rank cold")
    assert exe, "no warm-rank session: tests/conftest.py pytest_collection_finish starts one"
    return Path(exe)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny CPU run dir: its run.yaml's env is what `dskit train --local` gives its ranks."""
    return render_tiny(tmp_path_factory.mktemp("warm"))


def _rank(shim: Path, run: Path, env: dict[str, str]) -> subprocess.Popen:
    plan_env = {k: str(v) for k, v in yaml.safe_load((run / "run.yaml").read_text())["env"].items()}
    return subprocess.Popen(
        [str(shim), "-u", "-m", "dskit.train"],
        env={**os.environ, **plan_env, "RANK": "0", "LOCAL_RANK": "0", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _cold_log(shim: Path) -> list[dict]:
    log = shim.parent / "cold.log"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def _cold_since(shim: Path, before: int) -> dict[int, str]:
    """The cold starts logged after the first `before` (pids wrap at 32768 here: earlier ones may share)."""
    return {e["pid"]: e["reason"] for e in _cold_log(shim)[before:]}


@pytest.mark.parametrize(
    "env",
    [{}, {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}],
    ids=["the plan's env", "after this process imported DeepSpeed, which sets a variable"],
)
def test_a_forked_rank_answers_on_the_shims_streams_with_its_exit_code(shim, run, env):
    before, t0 = len(_cold_log(shim)), time.time()
    p = _rank(shim, run, env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err  # bad input: the trainer's own exit status, through the zygote
    assert "DSKIT_RUN_FILE: not set" in err, err
    assert p.pid not in _cold_since(shim, before)
    assert (shim.parent / f"shim-{p.pid}").stat().st_mtime >= t0 - 1  # this shim's rank was forked


def test_a_rank_under_another_environment_starts_cold_and_says_why(shim, run, tmp_path):
    before = len(_cold_log(shim))
    p = _rank(shim, run, {"HOME": str(tmp_path)})
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "DSKIT_RUN_FILE: not set" in err, err
    assert _cold_since(shim, before)[p.pid] == "environment differs from the zygote's in HOME"


def test_a_signal_to_the_shim_ends_the_forked_rank_and_a_killed_shim_takes_it_along(shim, run):
    """Rank 0 of two waits at the rendezvous for a rank 1 that never comes: SIGTERM to the shim (what
    torchrun sends) ends it as it ends a cold rank there; SIGKILL to the shim (torchrun's last resort)
    cannot be relayed, so the zygote kills the rank when the shim's connection drops."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        p = _rank(
            shim,
            run,
            {
                "DSKIT_RUN_FILE": str(run / "run.yaml"),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        mapping = shim.parent / f"shim-{p.pid}"
        deadline = time.monotonic() + 180
        while not _listening(port):  # the rank's rendezvous store: it waits for rank 1 there
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.1)
        rank = int(mapping.read_text().split()[0])
        p.send_signal(sig)
        p.wait(timeout=60)
        assert p.returncode == -sig
        deadline = time.monotonic() + 30
        while Path(f"/proc/{rank}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{rank}").exists(), f"the forked rank outlived its shim's {sig.name}"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
