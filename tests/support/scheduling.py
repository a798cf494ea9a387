"""How the suite runs on two cores: which tests share a worker, in which order, how long each may take,
and what each cost (a pytest plugin, loaded by tests/conftest.py).

- **Units** (pytest-xdist `--dist loadscope`, with this plugin's scheduler). A unit runs on one worker,
  one test after another: a test module (its module-scoped fixtures, such as a reference training run,
  are built once), or the modules that share something the machine holds once (the Slurm cluster, the
  Ray cluster, the pod hosts' namespaces: `SHARED`). Collection fails where a test uses a shared
  fixture from a module `SHARED` does not list, so a new module cannot race the others for it.
- **Order**: the units that cost most (tests/suite-cost.json, the last recorded run) start first, so the
  last one to finish is short (longest-processing-time-first); the quick modules fill in.
  `--no-loadscope-reorder` keeps xdist from re-sorting them by test count.
- **Timeouts** (pytest-timeout): a test that hangs fails with its name after `timeout_s(item)` seconds
  and the run goes on. A quick test gets `QUICK_TIMEOUT_S`; one that trains, runs a cluster or builds
  gets its marker's; `@pytest.mark.timeout(N)` overrides.
- **Alone**: a test marked `alone` compares times it measures (a plan's prediction with a training
  run's speed), which the other worker's load would skew: it waits until the other worker's current
  test ends, and the other worker starts nothing new until it is done (`_machine`).
- **Cost**: with `--suite-cost FILE`, every test's seconds (setup, call, teardown) and the run's totals
  are written there; `make suite-cost` copies the last one to tests/suite-cost.json, which orders the
  next runs and which docs/development.md quotes (tests/test_docs.py holds them equal). Tests that took
  long print a line as they end, so a log shows where the time went while the run goes on.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COST = REPO / "tests" / "suite-cost.json"

#: what the machine holds once -> (the fixture that sets it up, the modules whose tests use it): one unit
SHARED = {
    "slurm-cluster": ("cluster", ("tests/e2e/test_slurm.py", "tests/e2e/test_calibrate_cluster.py")),
    "ray-cluster": ("ray_cluster", ("tests/e2e/test_ray.py",)),
    "pod-hosts": ("pod_hosts", ("tests/render/test_helm.py", "tests/render/test_helm_workloads.py")),
}
_UNIT_OF_MODULE = {m: unit for unit, (_, modules) in SHARED.items() for m in modules}
#: seconds a test may take before it fails as hung, by marker (the first that applies)
TIMEOUT_S = {"image": 3600, "slurm": 900, "ray": 900, "train": 900, "slow": 900, "network": 900}
QUICK_TIMEOUT_S = 120
#: a test that took longer than this prints a line as it ends
LOUD_S = 20.0
#: tests recorded in suite-cost.json one by one (the rest only in the totals): the file stays small
RECORD_OVER_S = 0.5


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-cost", metavar="FILE", help="write every test's seconds and the totals here")


def unit_of(nodeid: str) -> str:
    """The unit a test runs in: its module, or the shared group its module belongs to."""
    module = nodeid.split("::", 1)[0]
    return _UNIT_OF_MODULE.get(module, module)


def check_shared(item: pytest.Item) -> None:
    """A test using a shared fixture must be in a module of that fixture's unit."""
    for unit, (fixture, _) in SHARED.items():
        if fixture in item.fixturenames and unit_of(item.nodeid) != unit:
            raise pytest.UsageError(
                f"{item.nodeid} uses the fixture {fixture!r}: add its module to SHARED[{unit!r}] in "
                "tests/support/scheduling.py, or two workers would set it up at once"
            )


def timeout_s(item: pytest.Item) -> int:
    return next((s for m, s in TIMEOUT_S.items() if item.get_closest_marker(m)), QUICK_TIMEOUT_S)


def recorded_seconds() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(COST.read_text())["tests"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        check_shared(item)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(timeout_s(item)))
        units.setdefault(unit_of(item.nodeid), []).append(item)
    seconds = recorded_seconds()
    cost = {u: sum(seconds.get(i.nodeid, 0.0) for i in its) for u, its in units.items()}
    # sorted() is stable: units of equal cost keep the collection's order
    items[:] = [i for u in sorted(units, key=lambda u: -cost[u]) for i in units[u]]


def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 (xdist's own type)
    """`--dist loadscope` with this file's units as the scopes (the controller sees nodeids only)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)


class _Machine:
    """A readers-writer lock over the machine, shared by the xdist workers of one run: every test holds
    it shared, an `alone` test exclusively. A turnstile taken before either keeps the other worker from
    starting test after test while an `alone` one waits (Linux's flock gives waiting writers no
    precedence). Without xdist there is no other worker, and nothing is locked."""

    def __init__(self, root: Path):
        self.turnstile, self.machine = (open(root / f"{n}.lock", "a+") for n in ("turnstile", "machine"))  # noqa: SIM115
        self.kept = False  # held alone since the last test, for the next: `alone` tests back to back

    def acquire(self, alone: bool) -> None:
        if self.kept:
            return
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def release(self, alone: bool, *, keep: bool = False) -> None:
        """`keep`: the next test on this worker is `alone` too, so the machine stays held for it: let go
        between them, the other worker starts a test (a minute of training, say) that the next must wait
        out, and then sits idle through it (140 s of one worker's waits in a run, 2026-12-06)."""
        self.kept = keep
        if keep:
            return
        fcntl.flock(self.machine, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def held(self, alone: bool, *, keep: bool = False):
        self.acquire(alone)
        try:
            yield
        finally:
            self.release(alone, keep=keep)


_MACHINE: _Machine | None = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201
    """Setup (module fixtures too), call and teardown under the machine lock."""
    global _MACHINE
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    if _MACHINE is None:  # in this run's temporary root, which both workers share and pytest cleans
        _MACHINE = _Machine(item.config._tmp_path_factory.getbasetemp().parent)  # noqa: SLF001
    alone = item.get_closest_marker("alone") is not None
    keep = alone and nextitem is not None and nextitem.get_closest_marker("alone") is not None
    asked = time.monotonic()
    with _MACHINE.held(alone, keep=keep):
        item.stash[_WAITED_S] = time.monotonic() - asked  # for the machine: an `alone` test on either side
        return (yield)


def busy_until(config: pytest.Config, done: Callable[[], object]) -> None:
    """Hold the machine as a test does until `done()` returns (in a thread): work this worker started
    in the background, such as the warm ranks' imports (tests/conftest.py), keeps an `alone` test from
    starting under it. Taken before returning, so before xdist hands out the first test (it waits for
    every worker's collection); on a lock of its own, since a test's unlock would drop a shared one.
    Without xdist there is no lock: the wait is here."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        done()
        return
    held = _Machine(config._tmp_path_factory.getbasetemp().parent).held(alone=False)  # noqa: SLF001
    held.__enter__()

    def wait() -> None:
        try:
            done()
        finally:
            held.__exit__(None, None, None)

    threading.Thread(target=wait, name="dskit-busy-until", daemon=True).start()


def _cpu_s() -> float:
    """CPU seconds of this process, of the children it has waited for (the trainers a test starts; not a
    Slurm job's processes, which are slurmd's) and of the ranks its zygotes forked (tests/support/warm_ranks.py)."""
    from tests.support.warm_ranks import forked_cpu_s

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + forked_cpu_s()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_AT_START] = _cpu_s()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ANN201
    report = yield
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        report.user_properties.append(("cpu_s", round(_cpu_s() - item.stash[_CPU_AT_START], 2)))
    if call.when == "teardown" and item.stash.get(_WAITED_S, 0.0) > 0.05:
        report.user_properties.append(("waited_s", round(item.stash[_WAITED_S], 2)))
    return report


_CPU_AT_START = pytest.StashKey[float]()
_WAITED_S = pytest.StashKey[float]()


class _Cost:
    """The controller's (or a serial run's) record of what each test took."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.outcomes: dict[str, str] = {}
        # per xdist worker: seconds in tests, and seconds waiting for the machine (an `alone` test)
        self.busy: dict[str, float] = {}
        self.waited: dict[str, float] = {}
        self.t0 = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration
        self.cpu.update((nodeid, v) for k, v in report.user_properties if k == "cpu_s")
        worker = getattr(getattr(report, "node", None), "gateway", None)
        wid = worker.id if worker is not None else "main"
        self.busy[wid] = self.busy.get(wid, 0.0) + report.duration
        for k, v in report.user_properties:
            if k == "waited_s":
                self.waited[wid] = self.waited.get(wid, 0.0) + v
        if report.when == "call" or report.outcome != "passed" or nodeid not in self.outcomes:
            self.outcomes[nodeid] = _outcome(report, self.outcomes.get(nodeid))
        if report.when == "teardown" and self.seconds[nodeid] > LOUD_S:
            tr = self.config.pluginmanager.get_plugin("terminalreporter")
            if tr is not None:
                cpu = self.cpu.get(nodeid)
                tr.write_line(
                    f"[{self.seconds[nodeid]:5.0f} s, cpu {'?' if cpu is None else f'{cpu:.0f}'} s] "
                    f"{self.outcomes[nodeid]:8s} {nodeid}"
                )

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        path = self.config.getoption("suite_cost")
        if not path:
            return
        counts: dict[str, int] = {}
        for o in self.outcomes.values():
            counts[o] = counts.get(o, 0) + 1
        workers = getattr(self.config.option, "numprocesses", None) or 0
        data = {
            "recorded": {
                "commit": _commit(),
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
                "cpus": os.cpu_count(),
                "machine": platform.processor() or platform.machine(),
                "workers": workers,
                "markers": self.config.getoption("markexpr") or "",
            },
            "wall_s": round(time.monotonic() - self.t0, 1),
            "test_s": round(sum(self.seconds.values()), 1),
            "cpu_s": round(sum(self.cpu.values()), 1),
            # what each worker did with the wall time: the rest of it is collection, start-up and
            # the end, where one worker has finished and the other has not
            "workers": {
                w: {"busy_s": round(self.busy[w], 1), "waited_s": round(self.waited.get(w, 0.0), 1)}
                for w in sorted(self.busy)
            },
            "count": len(self.outcomes),
            "outcomes": dict(sorted(counts.items())),
            "slowest": [
                [k, round(v, 1)] for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:10]
            ],
            "tests_over_s": RECORD_OVER_S,
            "tests": dict(sorted((k, round(v, 2)) for k, v in self.seconds.items() if v > RECORD_OVER_S)),
            "cpu": dict(
                sorted((k, v) for k, v in self.cpu.items() if self.seconds.get(k, 0) > RECORD_OVER_S)
            ),
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def _outcome(report: pytest.TestReport, before: str | None) -> str:
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    if report.skipped:
        return "skipped"
    return before if before in ("failed", "error", "xfailed", "xpassed", "skipped") else "passed"


def _commit() -> str | None:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return r.stdout.strip() or None


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # xdist's workers report to the controller, which records
        config.pluginmanager.register(_Cost(config), "dskit-suite-cost")


def main(argv: list[str]) -> int:
    """`make suite-cost`: the run recorded in FILE becomes tests/suite-cost.json, if it was a whole run
    that passed (a partial or failed run would order, and be quoted, as if it were the suite)."""
    if len(argv) != 1:
        print("usage: python -m tests.support.scheduling RUNS/TEST/suite-cost.json", file=sys.stderr)
        return 2
    data = json.loads(Path(argv[0]).read_text())
    bad = {k: n for k, n in data["outcomes"].items() if k in ("failed", "error")}
    if data["recorded"]["markers"] not in ("", "not image") or bad:
        print(
            f"{argv[0]}: not a whole passing run (markers {data['recorded']['markers']!r}, {bad})",
            file=sys.stderr,
        )
        return 2
    COST.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {COST.relative_to(REPO)}: {data['count']} tests, {data['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
