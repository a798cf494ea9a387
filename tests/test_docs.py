"""The docs cite tests by `tests/FILE.py::NAME` (the README's fault table above all): each must exist,
so a renamed or deleted test cannot leave a row promising a check that no longer runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
CITE = re.compile(r"tests/([\w/]+\.py)::(\w+)")


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def _citations() -> list[tuple[str, str, str]]:
    return [(d.name, *m.groups()) for d in DOCS if d.is_file() for m in CITE.finditer(d.read_text())]


def test_the_readme_cites_tests():
    assert len([c for c in _citations() if c[0] == "README.md"]) >= 15


@pytest.mark.parametrize(("doc", "file", "name"), _citations())
def test_every_cited_test_exists(doc, file, name):
    path = REPO / "tests" / file
    assert path.is_file(), f"{doc} cites tests/{file}, which does not exist"
    assert name in _functions(path), f"{doc} cites tests/{file}::{name}, which is not defined there"
