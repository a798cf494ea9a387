"""The import boundaries the architecture promises (docs/architecture.md): whatever reads a plan reads
`dskit.plan.schema` and never the decisions (`dskit.plan.build` and what it searches with); the
trainer reads prepared shards and never imports `dskit data prepare`'s side of `dskit.data`; no two
modules import each other, directly or around a loop, at the top or inside a function; and no module
name is used twice under dskit/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: every module of the package, by dotted name
MODULES = {_module_name(p): p for p in sorted((REPO / "dskit").rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The dskit modules `name` imports anywhere in its file (top, functions, TYPE_CHECKING blocks):
    `from dskit.x import y` names dskit.x.y where that is a module, else dskit.x."""
    path, found = MODULES[name], set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert GRAPH["dskit.render"] and GRAPH["dskit.train.entry"]  # the walk sees imports at all
    assert _cycles() == []


def test_the_trainer_imports_no_deciding_plan_module():
    """The trainer reads the plan's schema and the launch contract; what the plan decides with stays
    out of every rank (a refusal both sides raise lives in dskit/refusals.py). A calibration job's ranks
    (dskit/calibrate/job.py) are trainer ranks."""
    trainer = [
        m
        for m in MODULES
        if m.startswith("dskit.train") or m in ("dskit.launch.ray_train", "dskit.calibrate.job")
    ]
    climbs = {
        m: sorted(d for d in GRAPH[m] if d.startswith("dskit.plan") and d != "dskit.plan.schema")
        for m in trainer
    }
    assert {m: d for m, d in climbs.items() if d} == {}


#: the families dskit/'s shared modules live in, and what each may import outside itself: the small I/O
#: helpers and the file formats sit under everything; the launch contract under the trainer and every target;
#: the host checks (doctor, the compiled ops, the image build) on top of the launch contract and the trainer.
FAMILY_IMPORTS = {
    # atomic.py tells a run directory written before markers by the contract's run.yaml
    "dskit.io": {"dskit.errors", "dskit.launch.contract"},
    "dskit.formats": {"dskit.errors", "dskit.io"},
    # env_vars checks a GPU profile against the catalog; the launchers start the trainer and read its exits
    "dskit.launch": {"dskit.errors", "dskit.io", "dskit.catalog", "dskit.train"},
    # doctor runs the trainer's FP8 GEMM; jit_ops parses its flags as the CLI does; image_builder builds
    # what dskit/render/image.py renders
    "dskit.host": {
        "dskit.errors",
        "dskit.refusals",
        "dskit.io",
        "dskit.launch",
        "dskit.catalog",
        "dskit.cli.args",
        "dskit.render.image",
        "dskit.train.fp8.compute",
    },
}
#: the modules dskit/ holds beside its packages: what every family shares
TOP_LEVEL = {"dskit", "dskit.__main__", "dskit.errors", "dskit.refusals"}


def _within(module: str, names: set[str]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def test_each_family_imports_only_the_families_below_it():
    assert GRAPH["dskit.io.atomic"] and GRAPH["dskit.host.doctor"]  # the walk sees the families
    beyond = {
        m: sorted(d for d in GRAPH[m] if not _within(d, {family, *allowed}))
        for family, allowed in FAMILY_IMPORTS.items()
        for m in MODULES
        if _within(m, {family})
    }
    assert {m: d for m, d in beyond.items() if d} == {}


def test_the_top_level_is_families_and_what_they_share():
    """dskit/ holds its packages and at most 6 modules; each family's docstring says in one line what it
    owns."""
    top = {m for m in MODULES if m.count(".") <= 1 and MODULES[m].name != "__init__.py"} | {"dskit"}
    assert top == TOP_LEVEL and len(top) <= 6
    purposes = {f: ast.get_docstring(ast.parse(MODULES[f].read_text())) or "" for f in FAMILY_IMPORTS}
    assert {f: doc for f, doc in purposes.items() if not doc or "\n" in doc.strip()} == {}


def test_no_module_name_twice():
    """One name per idea: a module or package name appears once under dskit/ (besides __init__ and
    __main__), so a name in a traceback or a review points at one file."""
    names: dict[str, list[str]] = {}
    for name in MODULES:
        if name != "dskit":
            names.setdefault(name.rpartition(".")[2], []).append(name)
    names.pop("__main__", None)
    assert {n: m for n, m in names.items() if len(m) > 1} == {}


def _trainer_imports() -> list[str]:
    """Every trainer module, and every dskit module one of them imports, at the top or inside a
    function (entry.py reads its data lazily, so importing the trainer alone would not load it)."""
    trainer = [m for m in MODULES if m.startswith("dskit.train") and not m.endswith("__main__")]
    return sorted({*trainer, *(d for m in trainer for d in GRAPH[m])})


def test_the_trainer_does_not_import_data_prepare():
    modules = _trainer_imports()
    assert (
        "dskit.data.shards" in modules and "dskit.data.sampler" in modules
    )  # the walk sees entry's lazy imports
    assert _loaded_after_importing(modules, OFFLINE) == []


def _contract_file_names() -> set[str]:
    """The file and directory names dskit/launch/contract.py gives a run: its upper-case strings that name a
    file (a dot in them) and the storage root's default directories."""
    from dskit.launch import contract

    names = {v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str) and "." in v}
    return names | {contract.CHECKPOINTS_DIR, contract.OUTPUTS_DIR}


def test_a_run_file_name_is_spelled_only_in_the_launch_contract():
    """A run's file names (run.yaml, metrics.jsonl, local-run.json, calibration.json, the default
    checkpoints and outputs directories, ...) are written once, in dskit/launch/contract.py: a writer and a
    reader that spell one each drift apart on a rename."""
    names = _contract_file_names()
    assert {"run.yaml", "metrics.jsonl", "local-run.json", "checkpoints"} <= names  # the walk sees them
    spelled = sorted(
        f"{MODULES[m].relative_to(REPO)}:{node.lineno}: {node.value!r}"
        for m in MODULES
        if m != "dskit.launch.contract"
        for node in ast.walk(ast.parse(MODULES[m].read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and any(node.value == n or node.value.endswith("/" + n) for n in names)
    )
    assert spelled == []


#: the bench modules tests import: what they check of bench (tests/support/calibration.py reads the
#: measured rows and their re-predictions through the first three's `derived`)
BENCH_FOR_TESTS = {
    "bench.plan_bench",
    "bench.fp8_lora_bench",
    "bench.peer_bench",
    "bench.scale_table",
    "bench.pipeline_what_if",
    "bench.optimizer_refit",
    "bench.a2a_fit",
    "bench.cpu_fit",
    "bench.memsnap.sitecustomize",
    "bench.runs",  # when the trainer a result measured changed (runs.DEFERRED_LOGS_SINCE)
    "bench.calibrate_loop",  # its measured candidates and the spec each ran with (`derived`)
}


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` names in an import statement (`from a import b`: a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update({node.module, *(f"{node.module}.{a.name}" for a in node.names)})
    return found


def _bench_scripts_run_as_programs(path: Path) -> list[str]:
    """A path built to a script under bench/ (`REPO / "bench" / "SCRIPT.py"`, `REPO / "bench" / script`,
    "bench/SCRIPT.py") in `path`'s code: a test that runs a bench script as a program, which neither a reader
    nor this file can follow."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        parts: list = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            stack = [node]
            while stack:  # the operands of a / b / c, left to right
                n = stack.pop()
                if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
                    stack += [n.right, n.left]
                else:
                    parts.append(n.value if isinstance(n, ast.Constant) else None)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            parts = node.value.split("/") if node.value.startswith("bench/") else []
        if "bench" in parts[:-1] and (parts[-1] is None or str(parts[-1]).endswith((".py", ".sh"))):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_bench_sits_above_dskit_and_tests_import_what_they_check_of_it():
    """bench/ builds on dskit and the tests build on bench: no dskit module imports bench; the tests import
    BENCH_FOR_TESTS (and nothing else of bench), and run no bench script as a program."""
    assert not [
        m for m, p in MODULES.items() if any(i.split(".")[0] == "bench" for i in _imported_modules(p))
    ]
    tests = [p for p in sorted((REPO / "tests").rglob("*.py")) if "__pycache__" not in p.parts]
    imported = {i for p in tests for i in _imported_modules(p) if i.split(".")[0] == "bench"}
    assert {i for i in imported if i not in ("bench", "bench.memsnap")} == BENCH_FOR_TESTS
    assert [hit for p in tests for hit in _bench_scripts_run_as_programs(p)] == []
