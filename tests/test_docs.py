"""What the docs and the code's comments cite must exist: a test by `tests/FILE.py::NAME` (docs/faults.md's
table above all), and any repository path (`dskit/plan/memory.py`, `bench/results/*/h200-*.json`).
A renamed or deleted test, module or result cannot leave a sentence promising something that is not there.
The README is the front door: at most 250 lines, and its "Where things live" tour names every folder a
newcomer looks for (each top-level folder, each dskit/ package, each tests/ folder), and only folders that exist."""

from __future__ import annotations

import ast
import io
import itertools
import re
import tokenize
from pathlib import Path

import pytest

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
