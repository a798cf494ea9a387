"""The import boundaries the architecture promises (docs/architecture.md): whatever reads a plan reads
`dskit.plan.schema` and never the decisions (`dskit.plan.build` and what it searches with)."""

from __future__ import annotations

import subprocess
import sys

READERS = [
    "dskit.train.entry",
    "dskit.train.loop",
    "dskit.train.export",
    "dskit.train.local",
    "dskit.render.slurm",
    "dskit.render.helm",
    "dskit.render.ray",
    "dskit.render.image",
    "dskit.run_status",
    "dskit.report",
]
DECISIONS = [
    "dskit.plan.build",
    "dskit.plan.parallel",
    "dskit.plan.search",
    "dskit.plan.fit",
    "dskit.plan.speed",
]


def test_plan_readers_do_not_import_the_decisions():
    code = (
        "import importlib, sys\n"
        f"for m in {READERS!r}: importlib.import_module(m)\n"
        f"print(sorted(m for m in {DECISIONS!r} if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout
