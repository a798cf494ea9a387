"""DeepSpeed's compiled ops in a virtualenv (dskit/host/jit_ops.py): built once ahead of the run, and not
built again by a rank whose launcher gave it another PATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from dskit.host.build_locks import build_directory
from dskit.host.jit_ops import cached, prebuilt, use_own_builds, wanted
from tests.conftest import REPO, dskit
from tests.support.build_lock import LAYOUTS, use_cache

LOAD = """
import sys
from dskit.host.jit_ops import use_own_builds
if sys.argv[1] == "own":
    use_own_builds()
from deepspeed.ops.op_builder.all_ops import ALL_OPS
ALL_OPS["deepspeed_shm_comm"].load(verbose=False)
print("loaded")
"""


def _load(path: str, ninja: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LOAD, ninja],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path, "DS_ACCELERATOR": "cpu"},
        timeout=900,
    )


def _built(op: str) -> tuple[float, str]:
    """The op's library's mtime and ninja's build log in torch's cache."""
    d = build_directory(op)
    return (d / f"{op}.so").stat().st_mtime, (d / ".ninja_log").read_text()


def test_the_interpreters_own_ninja_goes_first_whatever_path_the_launcher_gave(monkeypatch):
    scripts = sysconfig.get_path("scripts")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    use_own_builds()
    assert os.environ["PATH"] == f"{scripts}:/usr/bin:/bin"
    use_own_builds()  # once is enough
    assert os.environ["PATH"] == f"{scripts}:/usr/bin:/bin"


ASK_CPU = """
import subprocess, torch
from dskit.host.jit_ops import use_own_builds
started = []
popen = subprocess.Popen.__init__
def counting(self, args, *a, **k):
    started.extend(a for a in args if str(a).endswith("cpuinfo.py"))
    popen(self, args, *a, **k)
subprocess.Popen.__init__ = counting
use_own_builds()
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.ops.op_builder.all_ops import ALL_OPS
b = ALL_OPS["cpu_adam"]
flags = [b.cpu_arch(), b.simd_width(), b.cpu_arch()]
DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
import cpuinfo
cpuinfo.get_cpu_info()["flags"].clear()  # a caller's copy: the next caller's answer is whole
print(len(started), flags[0] == flags[2], bool(cpuinfo.get_cpu_info()["flags"]))
"""


def test_a_rank_starts_py_cpuinfos_interpreter_once_whoever_asks():
    """DeepSpeed asks py-cpuinfo at each op load and in CPU Adam's constructor, and py-cpuinfo starts an
    interpreter at each call: once the trainer pinned its builds, the first answer serves the rest."""
    r = subprocess.run(
        [sys.executable, "-c", ASK_CPU],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["1", "True", "True"], r.stdout


def test_cpu_ranks_load_their_collectives_and_every_rank_cpu_adam():
    assert wanted(gpu=False) == ["cpu_adam", "deepspeed_shm_comm"]
    assert wanted(gpu=True) == ["cpu_adam", "fused_adam"]


@pytest.mark.parametrize("cache", LAYOUTS)
def test_the_build_directory_is_torchs_own_once_the_environment_is_pinned(cache, tmp_path, monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory

    use_cache(cache, tmp_path, monkeypatch)
    named = build_directory("cpu_adam")
    assert not named.exists() and named.is_relative_to(tmp_path)  # named, not created
    use_own_builds()  # as the trainer and `python -m dskit.host.jit_ops` do before DeepSpeed loads an op
    assert str(named) == _get_build_directory("cpu_adam", verbose=False)


def test_each_environment_builds_into_its_own_cache(tmp_path, monkeypatch):
    """Two virtualenvs of one Python (two checkouts) shared torch's one default folder and rebuilt each
    other's ops at each switch: each has its own folder now, beside the other in torch's cache."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    other = tmp_path / "other-venv"
    venv.create(other, with_pip=False, symlinks=True)
    site = subprocess.run(
        [other / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # this environment's packages (torch, dskit) seen from the other one, whose prefix differs
    Path(site, "this-env.pth").write_text(f"{sysconfig.get_path('purelib')}\n{REPO}\n")
    show = "from dskit.host.build_locks import extensions_root; print(extensions_root())"
    roots = [
        subprocess.run([py, "-c", show], capture_output=True, text=True, check=True).stdout.strip()
        for py in (sys.executable, str(other / "bin" / "python"))
    ]
    assert roots[0] != roots[1] and Path(roots[0]).parent == Path(roots[1]).parent, roots
    assert all(
        Path(r).name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}-env-") for r in roots
    )


@pytest.mark.slow
def test_an_op_built_ahead_is_not_built_again_by_a_rank_with_the_shells_path(tmp_path):
    """`make ops` builds shm_comm with the venv's ninja; a Slurm job of that venv starts its ranks with the
    user's shell PATH, where another ninja (Debian's here) or none comes first. Here a decoy `ninja`
    comes first, which fails and leaves a mark: loaded as the trainer loads it, the op is found built
    by the venv's ninja, the decoy never runs, the library and ninja's log stay as they were, and
    `dskit doctor` says it is built."""
    if prebuilt("deepspeed_shm_comm"):
        pytest.skip("DeepSpeed's install has shm_comm built in: no JIT")
    venv_first = f"{sysconfig.get_path('scripts')}:{os.environ['PATH']}"
    r = _load(venv_first, "as-given")  # built here if the cache lacks it (minutes), else only checked
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-3000:]
    before = _built("deepspeed_shm_comm")
    decoy = tmp_path / "bin"
    decoy.mkdir()
    mark = tmp_path / "decoy-ran"
    (decoy / "ninja").write_text(f"#!/bin/sh\ntouch '{mark}'\nexit 1\n")
    (decoy / "ninja").chmod(0o755)
    shell_path = f"{decoy}:/usr/local/bin:/usr/bin:/bin"

    r = _load(shell_path, "own")
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-3000:]
    assert not mark.exists()
    assert _built("deepspeed_shm_comm") == before
    # without it, torch runs the decoy: the test can tell
    r = _load(shell_path, "as-given")
    assert r.returncode != 0 and mark.exists()
    doctor = {c["name"]: c for c in json.loads(dskit("doctor", "--json").stdout)}
    assert doctor["deepspeed op deepspeed_shm_comm"]["status"] == "PASS"
    assert doctor["deepspeed op deepspeed_shm_comm"]["detail"].startswith(
        f"built in torch's extension cache ({cached('deepspeed_shm_comm').parent})"
    )


@pytest.mark.parametrize("flag", ["--gpu", "--frobnicate"])
def test_an_unknown_flag_is_refused_in_one_line_before_anything_is_built(flag):
    """As the dskit CLI refuses one (its parser, dskit/cli/args.py): no usage block, exit 2."""
    r = subprocess.run([sys.executable, "-m", "dskit.host.jit_ops", flag], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert (
        r.stderr
        == f"dskit: error: python -m dskit.host.jit_ops: unrecognized arguments: {flag} (see --help)\n"
    )


def _jit_ops(env: dict | None = None) -> tuple[int, list[str]]:
    """`python -m dskit.host.jit_ops`'s exit code and its own lines (DeepSpeed logs to stdout at import)."""
    r = subprocess.run(
        [sys.executable, "-m", "dskit.host.jit_ops"],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )
    # its own lines (torch's and DeepSpeed's warnings may hold a path with "dskit" in it)
    ours = [ln for ln in (r.stdout + r.stderr).split("\n") if ln.startswith(("dskit", "deepspeed op"))]
    return r.returncode, ours


@pytest.mark.slow  # a jit_ops process: torch and DeepSpeed load (seconds), not for the fast tier
def test_an_environment_value_that_does_not_parse_is_refused_before_anything_is_built():
    code, lines = _jit_ops({"DSKIT_IMAGE_ARCH": "sm_90"})
    assert code == 2
    assert lines == [
        "dskit: error: DSKIT_IMAGE_ARCH: 'sm_90' is not a compute capability MAJOR.MINOR, e.g. 9.0, or "
        "empty (a CPU image)"
    ]


@pytest.mark.slow  # a jit_ops process: torch and DeepSpeed load (seconds), not for the fast tier
def test_an_orphaned_lock_is_one_line_whatever_its_path_holds_and_its_fix_removes_it(tmp_path, monkeypatch):
    """A cache directory named with a newline, CR, ESC, BEL and a bidi override: one escaped line that
    poses as nothing else and sends no control character to the terminal, and the `rm -f` it names,
    pasted into bash, removes exactly that lock."""
    from dskit.io.text import first_unsafe
    from tests.support.build_lock import plant

    use_cache("TORCH_EXTENSIONS_DIR", tmp_path / FORGER, monkeypatch)
    lock = plant("deepspeed_shm_comm")
    code, lines = _jit_ops()
    assert code == 1
    (line,) = lines
    assert line.startswith("dskit.host.jit_ops: ") and first_unsafe(line) is None, line
    fix = line.split("without a message: ")[1].split(" (unless ")[0]
    subprocess.run(["bash", "-c", fix], check=True, cwd=tmp_path)
    assert not lock.exists() and lock.parent.is_dir()


#: a path or environment value that would print a line of its own posing as a check, colour the
#: terminal, ring it, and turn the rest of the line around
FORGER = "cache\nPASS  deepspeed op cpu_adam   prebuilt\r\x1b[31m\x07\u202e"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _results(proc: subprocess.CompletedProcess) -> list[str]:
    """The words of the lines a script printed after `RESULT` (DeepSpeed logs to stdout too)."""
    return [w for line in proc.stdout.splitlines() if line.startswith("RESULT ") for w in line.split()[1:]]


def test_deepspeed_is_imported_without_mlflow_unless_the_run_logs_to_it():
    """DeepSpeed's autotuner imports MLflow, a second of each rank's start: hidden from it unless the run
    tracks to MLflow, and importable again afterwards."""
    code = (
        "import sys\nfrom dskit.host.jit_ops import import_deepspeed\n"
        "import_deepspeed(mlflow={})\n"
        "from deepspeed.autotuning import autotuner\n"
        "print('RESULT', 'mlflow' in sys.modules, autotuner.has_mlflow)\n"
        "import mlflow\nprint('RESULT', mlflow.__name__)\n"
    )
    hidden = _python(code.format(False))
    assert hidden.returncode == 0, hidden.stderr[-2000:]
    assert _results(hidden) == ["False", "False", "mlflow"]
    tracked = _python(code.format(True))
    assert tracked.returncode == 0, tracked.stderr[-2000:]
    assert _results(tracked) == ["True", "True", "mlflow"]


def test_a_process_ended_without_teardown_still_finishes_its_threads_and_exit_handlers(tmp_path):
    """exit_without_teardown skips freeing the modules only: the threads that are not daemons finish,
    an idle thread pool's workers are told to leave (a fresh inductor cache leaves one behind: joined
    alone, its worker waits on its queue for ever), the exit handlers run, buffered output is written,
    and the code is the process's status."""
    code = f"""
import atexit, concurrent.futures, pathlib, threading, time
from dskit.launch.torchrun import exit_without_teardown
out = pathlib.Path({str(tmp_path)!r})
def late():
    time.sleep(0.5)
    (out / "thread").write_text("done")
threading.Thread(target=late).start()
idle_pool = concurrent.futures.ThreadPoolExecutor(1)
idle_pool.submit(int).result()
atexit.register(lambda: (out / "atexit").write_text("ran"))
print("buffered", end="")
exit_without_teardown(3)
"""
    r = _python(code)
    assert r.returncode == 3 and r.stdout == "buffered", (r.returncode, r.stdout, r.stderr[-2000:])
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"
