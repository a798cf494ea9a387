"""The committed GPU measurements as the calibration tests read them.

Result files are picked from bench/results/MANIFEST.yaml by their `series` (never by a file-name
glob). Their rows, and today's re-prediction of each, come from the bench script that wrote them,
imported (`bench.plan_bench.derived(files, predict)`, what its `--rows FILE... [--predict]` prints): how a
measured row maps back onto a spec is the bench's, and a test only compares it with what was measured.
Collection reads the rows (cheap); the first test that needs a prediction asks for the predictions of
every file this process has asked rows of at once, and the answers are kept for the session.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import yaml

from bench import fp8_lora_bench, peer_bench, plan_bench

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
MANIFEST = RESULTS / "MANIFEST.yaml"
#: the keys every manifest entry has (tests/test_results_manifest.py)
#: the bench scripts whose measured rows the tests read, by file name: each one's `derived(files, predict)`
DERIVED = {
    "plan_bench.py": plan_bench.derived,
    "fp8_lora_bench.py": fp8_lora_bench.derived,
    "peer_bench.py": peer_bench.derived,
}
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


def derived(script: str, files: tuple[Path, ...], predict: bool) -> list[dict]:
    """`bench/SCRIPT`'s rows of these result files (with today's predictions), as its `--rows` prints
    them: through JSON, so a row reads the same as the printed one (tuples as lists, keys as strings)."""
    return json.loads(json.dumps(DERIVED[script](list(files), predict)))


_ASKED: dict[str, set[Path]] = {}


def rows(script: str, *series: str) -> list[dict]:
    """The measured rows of these series as `bench/SCRIPT --rows` prints them (with `_source`, its file
    under bench/results/, and `_index`, its place among that file's rows)."""
    files = results(*series)
    _ASKED.setdefault(script, set()).update(files)
    return _rows(script, tuple(files))


@functools.cache
def _rows(script: str, files: tuple[Path, ...]) -> list[dict]:
    return derived(script, files, predict=False)


@functools.cache
def _predictions(script: str, files: tuple[Path, ...]) -> dict[tuple[str, int], dict]:
    return {(r["_source"], r["_index"]): r for r in derived(script, files, predict=True)}


def predicted(script: str, row: dict) -> dict:
    """`row` with today's prediction (`_predicted`; plan_bench.py also `_verdict` and `_pick`)."""
    return _predictions(script, tuple(sorted(_ASKED[script])))[row["_source"], row["_index"]]
