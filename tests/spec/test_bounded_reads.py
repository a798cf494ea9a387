"""Bounded reads (dskit/io/bounded_read.py), walked rather than listed:

- the package: every call of a parser or whole-file read (json.load(s), yaml.*load, safe_open,
  load_file, read_text, read_bytes) outside the two bounded readers is one of EXEMPT, each with its
  reason; a new unbounded reader fails here;
- the directories: every JSON file of a checkpoint, of a model directory and of a run's output, and
  every safetensors header, is made huge (a sparse multi-GB file, or a header length of GBs) or deeply
  nested in turn, and the command that reads it (`dskit export`, `dskit plan`, `dskit report`) answers
  in one line naming the file and its limit, exit 2, nothing written.
"""

from __future__ import annotations

import ast
import json
import os
import struct
import zlib
from pathlib import Path

import pytest

from dskit.io import bounded_read
from tests.conftest import REPO
from tests.support.cli import cli

PARSERS = {"loads", "load", "safe_load", "full_load", "unsafe_load", "safe_open", "load_file"}
WHOLE_READS = {"read_text", "read_bytes"}
BOUNDED = {"dskit/io/bounded_read.py", "dskit/spec/yamlsafe.py"}
#: (file, function) -> why it needs no bound: dskit's own files, or a bound elsewhere
EXEMPT = {
    ("dskit/catalog/__init__.py", "_load"): "the package's own catalogs",
    ("dskit/render/image.py", "toolchains"): "the package's own images.yaml",
    ("dskit/render/helm.py", "chart_files"): "the package's own Helm chart",
    ("dskit/calibrate/scales.py", "reference"): "the package's own reference calibration",
    ("dskit/host/image_builder.py", "source_root"): "dskit's own pyproject.toml",
    ("dskit/host/image_builder.py", "image_size"): "the container tool's answer on stdout, not a file",
    ("dskit/io/owner.py", "gone"): "os.pread of 64 KiB: bounded by the call",
    ("dskit/launch/contract.py", "read_exit_codes"): "one integer per file in the run's exit dir",
    ("dskit/status/report.py", "_img"): "a PNG this command has just written",
    ("dskit/train/lora/adapter_state.py", "load"): "the run's own adapter; safetensors bounds its header",
    ("dskit/train/checkpoints/routing_bias.py", "read"): "a file of the run's own verified checkpoint",
    ("dskit/train/lora/export_adapter.py", "trained"): "the run's own adapter; safetensors bounds its header",
    ("dskit/train/lora/export_adapter.py", "_files_of"): "a single file's names, after check_checkpoint",
    ("dskit/train/lora/export_adapter.py", "raw"): "shards checked by check_checkpoint first",
    ("dskit/train/fp8/loading.py", "shard_files"): "shards checked by check_checkpoint first",
    ("dskit/train/fp8/loading.py", "open_shards"): "shards checked by check_checkpoint first",
    ("dskit/data/readers.py", "_hf_dir_files"): "a dataset's state.json: user data, not a run's files",
    ("dskit/data/readers.py", "_read_jsonl"): "user data, parsed line by line by dskit data prepare",
    ("dskit/data/shards.py", "open"): "prepared data's index.json (a data dir, not yet bounded)",
}


def _calls() -> list[tuple[str, str, int, str]]:
    """(file, enclosing function, line, callee) of every parser or whole-file read in the package."""
    found = []
    for path in sorted((REPO / "dskit").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text())
        parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            parser = (
                name in PARSERS
                and base in ("json", "yaml", "")
                and name != "load"
                or (name == "load" and base in ("json", "yaml"))
            )
            if base == "bounded_read" or not (parser or name in WHOLE_READS):
                continue
            fn, up = "<module>", parents.get(node)
            while up is not None:
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    fn = up.name
                    break
                up = parents.get(up)
            found.append((rel, fn, node.lineno, name))
    return found


CALLS = _calls()


def test_the_walk_finds_the_readers():
    files = {f for f, *_ in CALLS}
    assert {"dskit/io/bounded_read.py", "dskit/catalog/__init__.py"} <= files and len(CALLS) > 20


def test_every_parser_outside_the_bounded_readers_is_exempt_for_a_reason():
    loose = [
        f"{f}:{line} {fn}() calls {name}"
        for f, fn, line, name in CALLS
        if f not in BOUNDED and (f, fn) not in EXEMPT
    ]
    assert not loose, "read through dskit.io.bounded_read (or exempt, with a reason):\n" + "\n".join(loose)


def test_no_exemption_is_stale():
    used = {(f, fn) for f, fn, *_ in CALLS}
    assert not set(EXEMPT) - used, set(EXEMPT) - used


# --------------------------------------------------------------------------- the reader itself


def test_a_sparse_multi_gb_file_is_refused_by_its_size_before_a_byte_is_read(tmp_path):
    f = tmp_path / "dskit.json"
    with f.open("wb") as fh:
        fh.truncate(8 << 30)
    with pytest.raises(bounded_read.TooLarge) as e:
        bounded_read.read_json(f, limit=1 << 20, what="a checkpoint's dskit.json")
    assert str(e.value) == f"{f} is 8,589,934,592 bytes, over the 1,048,576 a checkpoint's dskit.json can be"


@pytest.mark.parametrize(
    "make",
    [lambda p: os.mkfifo(p), lambda p: p.mkdir(), lambda p: p.symlink_to("/dev/zero")],
    ids=["fifo", "directory", "link to /dev/zero"],
)
def test_what_is_not_a_regular_file_is_refused_without_blocking(tmp_path, make):
    make(tmp_path / "x.json")
    with pytest.raises(bounded_read.TooLarge, match="is not a regular file"):
        bounded_read.read_json(tmp_path / "x.json", limit=10, what="x")


@pytest.mark.parametrize("deep", [33, 100_000])
def test_nesting_is_bounded(tmp_path, deep):
    f = tmp_path / "a.json"
    f.write_text("[" * deep + "]" * deep)
    with pytest.raises(bounded_read.TooLarge, match="nests deeper than 32 levels"):
        bounded_read.read_json(f, limit=1 << 20, what="x")


def test_a_jsonl_line_over_its_limit_is_refused_and_torn_lines_are_none(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_bytes(b'{"step": 1}\n{"ste\n' + b"\0" * 100)
    assert list(bounded_read.iter_jsonl(f, line_limit=1000, what="metrics")) == [{"step": 1}, None, None]
    with pytest.raises(bounded_read.TooLarge, match="line 3 is over the 20 bytes a line of metrics can be"):
        list(bounded_read.iter_jsonl(f, line_limit=20, what="metrics"))


# --------------------------------------------------------------------------- the directories, walked

TINY = ["--gpu", "cpu", "--gpus-per-node", "2", "--model", "tiny-v2", "--set", "training.seq_len=128"]
CPU = [*TINY, "--set", "storage.root=/shared/dskit"]
NO_TRAIN = "needs the train extra"


def _huge(p: Path) -> str:
    """Make `p` too large to read: a sparse 8 GiB file, or, for safetensors, a header length of 8 GiB."""
    if p.suffix == ".safetensors":
        with p.open("r+b") as f:
            f.write(struct.pack("<Q", 8 << 30))
        return "over the 104,857,600 it can be"
    with p.open("r+b") as f:
        f.truncate(8 << 30)
    return "8,589,934,592 bytes, over the"


def _deep(p: Path) -> str:
    doc = b"[" * 100_000 + b"]" * 100_000
    p.write_bytes(struct.pack("<Q", len(doc)) + doc if p.suffix == ".safetensors" else doc)
    return "nests deeper than 32 levels"


def _checkpoint(d: Path) -> tuple[list[str], Path]:
    """A rendered run with one checkpoint whose files check out: the export's args, the checkpoint."""
    run, ck = d / "run", d / "ck"
    cli("render", "slurm", *CPU, "--set", f"storage.checkpoint_dir={ck}", "-o", str(run), check=True)
    tag = ck / "step00000001"
    tag.mkdir(parents=True)
    (tag / "f.pt").write_bytes(b"x")
    (tag / "dskit-manifest-rank0.json").write_text(json.dumps({"f.pt": [1, zlib.crc32(b"x")]}))
    (tag / "dskit.json").write_text('{"step": 1, "world_size": 1}')
    return ["export", str(run), "-o", str(d / "hf")], tag


def _model_dir(d: Path) -> tuple[list[str], Path]:
    from tests.spec.test_bad_input import TINY_CONFIG, safetensors

    m = d / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps(TINY_CONFIG))
    t = {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}
    (m / "a.safetensors").write_bytes(safetensors({"a": t}))
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "a.safetensors"}}))
    return ["plan", *TINY[:4], "--set", "training.seq_len=128", "--set", f"model.path={m}"], m


def _outputs(d: Path) -> tuple[list[str], Path]:
    run, out = d / "run", d / "out"
    cli("render", "slurm", *CPU, "--set", f"storage.output_dir={out}", "-o", str(run), check=True)
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (out / "launch-env.json").write_text('{"A": "1"}')
    return ["report", str(run), "-o", str(d / "report")], out


DIRS = {"checkpoint": _checkpoint, "model directory": _model_dir, "run outputs": _outputs}


def _files(kind: str) -> list[str]:
    """The JSON files and safetensors of one directory as the setup writes it: walked, not listed."""
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        _, d = _files_setup(kind, Path(t))
        return sorted(p.name for p in d.iterdir() if p.suffix in (".json", ".jsonl", ".safetensors"))


def _files_setup(kind: str, d: Path) -> tuple[list[str], Path]:
    if kind == "model directory":  # writes no run dir: cheap to build at collection
        return _model_dir(d)
    d.mkdir(exist_ok=True)
    # the others need a rendered run; their file names do not depend on it
    return {"checkpoint": _names_checkpoint, "run outputs": _names_outputs}[kind](d)


def _names_checkpoint(d: Path) -> tuple[list[str], Path]:
    (d / "t").mkdir()
    for name in ("dskit.json", "dskit-manifest-rank0.json"):
        (d / "t" / name).write_text("{}")
    return [], d / "t"


def _names_outputs(d: Path) -> tuple[list[str], Path]:
    for name in ("metrics.jsonl", "launch-env.json"):
        (d / name).write_text("{}")
    return [], d


CASES = [(kind, name, how) for kind in DIRS for name in _files(kind) for how in ("huge", "deep")]


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.stat().st_size if p.is_file() else None for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize(("kind", "name", "how"), CASES, ids=[" ".join(c) for c in CASES])
def test_every_file_a_command_reads_is_bounded(tmp_path, kind, name, how):
    args, d = DIRS[kind](tmp_path)
    says = (_huge if how == "huge" else _deep)(d / name)
    if name == "metrics.jsonl" and how == "huge":
        says = "line 2 is over the 4,194,304 bytes a line of metrics.jsonl can be"  # a run of NULs
    before = _snapshot(tmp_path)
    r = cli(*args, cwd=tmp_path)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("dskit: error: "), lines
    assert NO_TRAIN in lines[0] or (says in lines[0] and name in lines[0]), lines[0]
    assert _snapshot(tmp_path) == before, "something was written"
