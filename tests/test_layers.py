"""The import boundaries the architecture promises (docs/architecture.md): whatever reads a plan reads
`dskit.plan.schema` and never the decisions (`dskit.plan.build` and what it searches with); the
trainer reads prepared shards and never imports `dskit data prepare`'s side of `dskit.data`."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.conftest import REPO

READERS = [
    "dskit.train.entry",
    "dskit.train.loop",
    "dskit.train.export",
    "dskit.train.local",
    "dskit.render.slurm",
    "dskit.render.helm",
    "dskit.render.ray",
    "dskit.render.image",
    "dskit.status.run_status",
    "dskit.status.report",
]
DECISIONS = [
    "dskit.plan.build",
    "dskit.plan.parallel",
    "dskit.plan.search",
    "dskit.plan.fit",
    "dskit.plan.speed",
]


def _loaded_after_importing(modules: list[str], watched: list[str]) -> list[str]:
    """Which of `watched` a fresh interpreter holds after importing `modules`."""
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(' '.join(sorted(m for m in {watched!r} if m in sys.modules)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


def test_plan_readers_do_not_import_the_decisions():
    assert _loaded_after_importing(READERS, DECISIONS) == []


# `dskit data prepare` runs before the job, outside the container's trainer: its inputs' readers, chat
# templating and tokenizer pool are no part of what a rank loads.
OFFLINE = ["dskit.data.prepare", "dskit.data.encode", "dskit.data.readers", "dskit.data.chat"]


def _trainer_imports() -> list[str]:
    """Every trainer module, and every dskit module one of them imports, at the top or inside a
    function (entry.py reads its data lazily, so importing the trainer alone would not load it)."""
    files = sorted((REPO / "dskit" / "train").glob("*.py"))
    names = {f"dskit.train.{f.stem}" for f in files if f.stem not in ("__init__", "__main__")}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dskit"):
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.startswith("dskit"))
    return sorted(names)


def test_the_trainer_does_not_import_data_prepare():
    modules = _trainer_imports()
    assert (
        "dskit.data.shards" in modules and "dskit.data.sampler" in modules
    )  # the walk sees entry's lazy imports
    assert _loaded_after_importing(modules, OFFLINE) == []
