"""What the docs and the code's comments cite must exist: a test by `tests/FILE.py::NAME` (docs/faults.md's
table above all), and any repository path (`dskit/plan/memory.py`, `bench/results/*/h200-*.json`).
A renamed or deleted test, module or result cannot leave a sentence promising something that is not there.
The README is the front door: at most 250 lines, and its "Where things live" tour names every folder a
newcomer looks for (each top-level folder, each dskit/ package, each tests/ folder), and only folders that exist."""

from __future__ import annotations

import ast
import io
import itertools
import json
import re
import tokenize
from pathlib import Path

import pytest

from tests.support import peer_row

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "bench" / "README.md"]
CODE = sorted(p for d in ("dskit", "bench", "tests") for p in (REPO / d).rglob("*.py"))
CITE = re.compile(r"tests/([\w/]+\.py)::(\w+)")
# A path from the repository root. Placeholders are capitals (bench/results/RESULT.json) and cite only
# the folder before them; braces are alternatives (h200x2-planner-{A,C}-2026-11-30.json).
TOP = "dskit|tests|bench|docs|templates|helm|images|slurm|examples"
PATH = re.compile(rf"(?<![\w/.{{-])((?:{TOP})/[\w./*{{}},-]*[\w*}}])")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.\w+)?$")


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def _prose(path: Path) -> str:
    """A doc whole; of a Python file only its comments and docstrings (string literals in code are
    data, such as a template's name relative to templates/)."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    parts = [
        t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(ast.get_docstring(node) or "")
    return "\n".join(parts)


def _citations() -> list[tuple[str, str, str]]:
    return [(d.name, *m.groups()) for d in DOCS if d.is_file() for m in CITE.finditer(d.read_text())]


def _expand(path: str) -> list[str]:
    pieces = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(pieces)]
    return ["".join(c) for c in itertools.product(*choices)]


def _cited_paths() -> list[tuple[str, str]]:
    found = set()
    for f in [*DOCS, *CODE]:
        if f.is_file():
            for m in PATH.finditer(_prose(f)):
                found.add((str(f.relative_to(REPO)), m.group(1).rstrip(".,")))
    return sorted(found)


def _exists(path: str) -> bool:
    if "*" not in path and (REPO / path).exists():  # README.md is a name, not a placeholder
        return True
    parts = path.split("/")
    for i, part in enumerate(parts):
        if PLACEHOLDER.match(part):
            parts = parts[:i]
            break
    pattern = "/".join(parts)
    return any(REPO.glob(pattern)) if "*" in pattern else (REPO / pattern).exists()


def test_the_fault_table_cites_tests():
    assert len([c for c in _citations() if c[0] == "faults.md"]) >= 15


def test_docs_lists_every_doc_under_docs():
    assert {p for p in (REPO / "docs").rglob("*.md")} <= set(DOCS)
    assert len(DOCS) > 10


README_MAX_LINES = 250
TOUR_HEADING = "## Where things live"
TOUR_FOLDER = re.compile(r"`(\.?[\w./-]+)/`")
# Not the repository's: made by `make setup`, `make demo`, tools and builds (all in .gitignore).
NOT_OURS = {"runs", "build", "dist", "__pycache__"}


def _tour() -> str:
    text = (REPO / "README.md").read_text()
    assert TOUR_HEADING in text, f"README.md has no {TOUR_HEADING!r} section"
    tour = text.split(TOUR_HEADING, 1)[1]
    return tour.split("\n## ", 1)[0]


def _tour_folders() -> set[str]:
    return set(TOUR_FOLDER.findall(_tour()))


def test_the_readme_is_a_front_door_of_at_most_250_lines():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_folder_the_tour_names_exists():
    folders = _tour_folders()
    assert len(folders) > 20
    missing = sorted(f for f in folders if not (REPO / f).is_dir())
    assert not missing, f"README.md's tour names folders that do not exist: {missing}"


def _wanted_folders() -> set[str]:
    top = {
        p.name
        for p in REPO.iterdir()
        if p.is_dir()
        and (not p.name.startswith(".") or p.name == ".ci")
        and p.name not in NOT_OURS
        and not p.name.endswith(".egg-info")
    }
    packages = {str(p.parent.relative_to(REPO)) for p in (REPO / "dskit").rglob("__init__.py")}
    tests = {
        str(p.relative_to(REPO))
        for p in (REPO / "tests").iterdir()
        if p.is_dir() and p.name not in NOT_OURS and not p.name.startswith(".")
    }
    return top | packages | tests


def test_the_tour_names_every_top_level_folder_package_and_test_folder():
    unnamed = sorted(_wanted_folders() - _tour_folders())
    assert not unnamed, f"README.md's tour ({TOUR_HEADING!r}) has no line for: {unnamed}"


@pytest.mark.parametrize(("doc", "file", "name"), _citations())
def test_every_cited_test_exists(doc, file, name):
    path = REPO / "tests" / file
    assert path.is_file(), f"{doc} cites tests/{file}, which does not exist"
    assert name in _functions(path), f"{doc} cites tests/{file}::{name}, which is not defined there"


def test_every_cited_path_exists():
    paths = _cited_paths()
    assert len(paths) > 100  # the scan reads the docs and the comments, not nothing
    missing = [f"{where} cites {p}" for where, p in paths if not all(_exists(x) for x in _expand(p))]
    assert not missing, "\n".join(missing)


# A work item (the word issue and its number) is nothing a reader of the code can open: a comment says the reason, or cites a
# file, a doc section or a measurement. An upstream thread is cited with its repository and '#'
# (NVIDIA/nccl-tests issue #119, DeepSpeed PR #8424), which stays.
WORK_ITEM = re.compile(r"(?i)\bissues? \d+|(?<!issue )(?<!PR )(?<![^\s(])#\d+\b")
#: code whose comments are checked: Python's comments and docstrings, the templates and shell scripts whole
COMMENTED = sorted(
    p
    for d in ("dskit", "tests", "bench", "templates")
    for p in (REPO / d).rglob("*")
    if p.suffix in (".py", ".sh", ".j2") and "__pycache__" not in p.parts
)


def work_items(text: str) -> list[str]:
    return [m.group(0) for m in WORK_ITEM.finditer(text)]


def test_the_work_item_rule_tells_a_work_item_from_an_upstream_thread():
    assert work_items("faster at micro-batch 1 (issue 49); issues 25, 28; Issue 13's goal; see #61") == [
        "issue 49",
        "issues 25",
        "Issue 13",
        "#61",
    ]
    assert work_items("NVIDIA/nccl-tests issue #119, DeepSpeed PR #8424, color:#222, `issue31`") == []


def test_comments_cite_no_work_item():
    assert len(COMMENTED) > 100
    found = [
        f"{p.relative_to(REPO)}: {hit}"
        for p in COMMENTED
        for hit in work_items(_prose(p) if p.suffix == ".py" else p.read_text())
    ]
    assert not found, "say the reason, or cite a file, a doc section or a measurement:\n" + "\n".join(found)


MAP = REPO / "docs" / "architecture.md"
TOUR_PACKAGE_LINE = re.compile(r"^- `(dskit/[\w/]*)/`:", re.M)


def _unmapped_modules() -> list[str]:
    """Module files under dskit/ that neither the README's tour nor docs/architecture.md's map names: by
    their path anywhere in either, or by their file name in the tour's line for their package."""
    tour, named = _tour(), (REPO / "README.md").read_text() + MAP.read_text()
    lines = {
        m.group(1): tour[m.start() : tour.find("\n", m.start())] for m in TOUR_PACKAGE_LINE.finditer(tour)
    }
    return [
        rel
        for p in sorted((REPO / "dskit").rglob("*.py"))
        if p.name not in ("__init__.py", "__main__.py")  # a package is named by its folder (above)
        and (rel := str(p.relative_to(REPO))) not in named
        and f"`{p.name}`" not in lines.get(str(p.parent.relative_to(REPO)), "")
    ]


def test_every_module_file_is_in_the_tour_or_the_map():
    assert len(list((REPO / "dskit").rglob("*.py"))) > 100
    assert _unmapped_modules() == [], "add one line each to README.md's tour or docs/architecture.md's map"


DEVELOPMENT = REPO / "docs" / "development.md"
SUITE_COST = REPO / "tests" / "suite-cost.json"
#: docs/development.md's words for the outcomes pytest counts
OUTCOME_WORDS = {
    "passed": "passed",
    "failed": "failures",
    "xfailed": "expected failures",
    "skipped": "skipped",
}


def suite_figures(cost: dict) -> list[str]:
    """What the `make test` row of docs/development.md's table states, recomputed from a recorded run
    (`make suite-cost` writes tests/suite-cost.json)."""
    rec, outcomes = cost["recorded"], cost["outcomes"]
    counted = ", ".join(f"{n:,} {OUTCOME_WORDS.get(k, k)}" for k, n in outcomes.items() if n)
    return [
        f"{cost['count']:,} tests: {counted}",
        f"{cost['wall_s'] / 60:.1f} minutes of pytest ({cost['test_s']:,.0f} test-seconds on {rec['workers']} workers)",
        f"at commit {rec['commit']} ({rec['date']}), on {rec['cpus']} cores",
    ]


def stale_suite_figures(doc: str, cost: dict) -> list[str]:
    """The recorded run's figures the table's `make test` row does not state, and every commit the
    table names that is not the recorded run's (a tier measured at another commit is stale too)."""
    table = doc.split("## Suite size and duration", 1)[1].split("\n## ", 1)[0]
    (row,) = [line for line in table.splitlines() if line.startswith("| `make test` ")]
    stale = [f for f in suite_figures(cost) if f not in row]
    commit = cost["recorded"]["commit"]
    stale += [f"commit {c}" for c in re.findall(r"\bcommit ([0-9a-f]{7,40})\b", table) if c != commit]
    return stale


def test_the_suite_figures_are_the_last_recorded_runs():
    cost = json.loads(SUITE_COST.read_text())
    assert stale_suite_figures(DEVELOPMENT.read_text(), cost) == []
    # a run recorded after the table was written leaves every figure of it stale
    later = {**cost, "count": cost["count"] + 1, "wall_s": cost["wall_s"] + 60, "test_s": cost["test_s"] + 9}
    later["recorded"] = {**cost["recorded"], "commit": "0000000"}
    assert len(stale_suite_figures(DEVELOPMENT.read_text(), later)) >= 4


def test_the_support_pages_gpu_row_is_the_newest_peer_results():
    """docs/support.md's comparison with torchtitan is tests/support/peer_row.py's sentence from
    bench/results/peer/: a newer result changes it, and the page must be regenerated (--write)."""
    doc = (REPO / "docs" / "support.md").read_text()
    for gpu, shapes in (("H200", 5), ("H100", 4)):  # every shape of peer_bench's calls on that GPU
        found = peer_row.newest(peer_row.results(), gpu)
        assert len(found) >= shapes, gpu
        assert peer_row.render(doc, gpu, found) == doc, "run: python -m tests.support.peer_row --write"


def test_a_newer_peer_result_replaces_the_older_one_of_its_shape():
    results = peer_row.results()
    name, res = next((n, r) for n, r in results.items() if "s4096-2026-12-04c" in n)
    later = json.loads(json.dumps(res))
    later["date"] = "2099-01-01T00:00:00+00:00"
    for row in later["rows"]:
        if row["system"] == "dskit":
            row["tok_s_gpu"] //= 2
    found = peer_row.newest({**results, "h200-vs-torchtitan-later.json": later}, "H200")
    assert {f["file"] for f in found.values()} >= {"h200-vs-torchtitan-later.json"}
    assert "behind to ahead" in peer_row.sentence(found)
