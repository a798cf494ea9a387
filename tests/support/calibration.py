"""The committed GPU measurements as the calibration tests read them, without importing bench/.

Result files are picked from bench/results/MANIFEST.yaml by their `series` (never by a file-name
glob). Their rows, and today's re-prediction of each, come from the bench script that wrote them, run
as a program (`python bench/plan_bench.py --rows FILE... [--predict]`): how a measured row maps back
onto a spec is the bench's, and a test only compares what it prints with what was measured.
Collection reads the rows (cheap); the first test that needs a prediction runs one `--predict` call
over every file this process has asked rows of, and the answers are kept for the session.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
MANIFEST = RESULTS / "MANIFEST.yaml"
#: the keys every manifest entry has (tests/test_results_manifest.py)
REQUIRED = ("path", "topic", "series", "measured", "script", "hardware", "date", "command", "commit")


@functools.cache
def manifest() -> tuple[dict, ...]:
    return tuple(yaml.safe_load(MANIFEST.read_text())["results"])


def results(*series: str) -> list[Path]:
    """The result files of these series, in path order."""
    found = sorted(RESULTS / e["path"] for e in manifest() if e["series"] in series)
    assert found, f"no result of series {series} in {MANIFEST}"
    return found


def result(name: str) -> Path:
    """A result file by its name (without its topic folder), through the manifest."""
    (path,) = [RESULTS / e["path"] for e in manifest() if Path(e["path"]).name == name]
    return path


def bench(script: str, *args: str) -> object:
    """Run `bench/SCRIPT ARGS` and read the JSON it prints."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0, f"bench/{script} {' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr}"
    return json.loads(proc.stdout)


_ASKED: dict[str, set[Path]] = {}


def rows(script: str, *series: str) -> list[dict]:
    """The measured rows of these series as `bench/SCRIPT --rows` prints them (with `_source`, its file
    under bench/results/, and `_index`, its place among that file's rows)."""
    files = results(*series)
    _ASKED.setdefault(script, set()).update(files)
    return _rows(script, tuple(files))


@functools.cache
def _rows(script: str, files: tuple[Path, ...]) -> list[dict]:
    return bench(script, "--rows", *map(str, files))


@functools.cache
def _predictions(script: str, files: tuple[Path, ...]) -> dict[tuple[str, int], dict]:
    return {(r["_source"], r["_index"]): r for r in bench(script, "--rows", *map(str, files), "--predict")}


def predicted(script: str, row: dict) -> dict:
    """`row` with today's prediction (`_predicted`; plan_bench.py also `_verdict` and `_pick`)."""
    return _predictions(script, tuple(sorted(_ASKED[script])))[row["_source"], row["_index"]]
