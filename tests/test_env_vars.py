"""Every environment variable dskit reads goes through dskit/launch/env_vars.py, and a value that does not
parse is one line naming the variable and the form it allows: in `dskit doctor` a FAIL line (doctor reports,
exit 1), in the trainer and `python -m dskit.host.jit_ops` a refusal (exit 2), never a traceback."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from dskit.errors import SpecError
from dskit.launch import env_vars
from tests.conftest import REPO, render_tiny
from tests.support.cli import cli, import_first

HOSTILE_TEXT = ["", " ", "a\nPASS  gpu  forged", "\r\x1b[31m\x07", "\u202e", "$(touch pwned)"]

#: for each variable: values it refuses, and values it takes (and what they read as)
BAD: dict[str, list[str]] = {
    "DSKIT_SHM_BYTES": ["abc", "1e9", "", "-5", " 5", "+5", "5.0", "٣", "1_000", "1" * 19],
    "DSKIT_GPU_PROFILE": ["h100", "", "CPU", "cpu ", "h100-80gb\n"],
    "RANK": ["abc", "", "-1", "0x1", "1.0", "٣"],
    "LOCAL_RANK": ["abc", "", "-1", "1e0"],
    "WORLD_SIZE": ["four", "", "4 ", "+4"],
    "DSKIT_IMAGE_ARCH": ["9", "sm_90", "9.0a", " 9.0", "9.0\n"],
    "DSKIT_IMAGE_FLASH_ATTN": ["fa3", "", "FA2", "none\n"],
    "NCCL_IB_DISABLE": ["true", "", "2", " 0"],
}
GOOD: dict[str, list[tuple[str, object]]] = {
    "DSKIT_SHM_BYTES": [("17179869184", 17179869184), ("0", 0)],
    "DSKIT_GPU_PROFILE": [("h100-80gb", "h100-80gb"), ("cpu", "cpu")],
    "RANK": [("0", 0), ("12", 12)],
    "LOCAL_RANK": [("3", 3)],
    "WORLD_SIZE": [("4", 4)],
    "DSKIT_IMAGE_ARCH": [("9.0", "9.0"), ("12.0", "12.0"), ("", "")],
    "DSKIT_IMAGE_FLASH_ATTN": [("fa2", "fa2"), ("fa4", "fa4"), ("none", "none")],
    "NCCL_IB_DISABLE": [("0", "0"), ("1", "1")],
}
#: variables of any text (paths, commands, URIs): they take every string as it is
TEXT = [name for name, form in env_vars.VARIABLES.items() if form is env_vars.TEXT]


def test_the_tables_cover_every_variable_dskit_reads():
    assert set(BAD) == set(GOOD) == set(env_vars.VARIABLES) - set(TEXT)


def _env_reads(path) -> list[str]:
    """Where `path` reads the environment other than through env_vars: os.environ.get, os.getenv,
    os.environ[...] read, `in os.environ`, a name imported from os. Writes (os.environ[...] = ...,
    setdefault) and handing the whole environment to a child ({**os.environ, ...}) are not reads."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{path}:{node.lineno} from os import {a.name}" for a in node.names if "env" in a.name]
        if not (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
        ):
            continue
        if node.attr in ("getenv", "getenvb", "environb"):
            found.append(f"{path}:{node.lineno} os.{node.attr}")
        elif node.attr == "environ":
            up = parents[node]
            writes = (isinstance(up, ast.Subscript) and isinstance(up.ctx, ast.Store)) or (
                isinstance(up, ast.Attribute) and up.attr == "setdefault"
            )
            handed_on = isinstance(up, ast.Dict) and None in up.keys
            if not (writes or handed_on):
                found.append(f"{path}:{node.lineno} os.environ")
    return found


def test_every_environment_read_under_dskit_goes_through_env_vars():
    reads = [
        r for p in sorted((REPO / "dskit").rglob("*.py")) if p.name != "env_vars.py" for r in _env_reads(p)
    ]
    assert reads == []
    assert _env_reads(REPO / "dskit" / "launch" / "env_vars.py")  # the walk sees a read where there is one


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_value_that_does_not_parse_is_one_line_naming_the_variable_and_its_form(name, monkeypatch):
    form = env_vars.VARIABLES[name]
    for value in BAD[name]:
        monkeypatch.setenv(name, value)
        with pytest.raises(SpecError) as e:
            env_vars.read(name)
        text = str(e.value)
        assert e.value.field == name and form.allowed in text and "\n" not in text, text
    for value, parsed in GOOD[name]:
        monkeypatch.setenv(name, value)
        assert env_vars.read(name) == parsed
    monkeypatch.delenv(name)
    assert env_vars.read(name) is None


@pytest.mark.parametrize("name", TEXT)
def test_a_text_variable_takes_any_text_as_it_is(name, monkeypatch):
    for value in HOSTILE_TEXT:
        monkeypatch.setenv(name, value)
        assert env_vars.read(name) == value


#: the variables `dskit doctor` reads that have a form, and the check each one feeds
DOCTOR = [
    "DSKIT_SHM_BYTES",
    "DSKIT_GPU_PROFILE",
    "DSKIT_IMAGE_FLASH_ATTN",
    "NCCL_IB_DISABLE",
    "DSKIT_IMAGE_ARCH",
]


@pytest.mark.parametrize("shm", BAD["DSKIT_SHM_BYTES"][:4])
def test_doctor_reports_every_value_that_does_not_parse_as_a_fail_line_and_goes_on(shm):
    """DSKIT_SHM_BYTES=abc (1e9, '', -5) was a ValueError traceback: now each variable that does not
    parse is its own FAIL line naming it and its form, every other check still runs, exit 1 (doctor's
    code for a failed check, `dskit doctor --help`)."""
    env = {name: BAD[name][i % len(BAD[name])] for i, name in enumerate(DOCTOR)}
    env["DSKIT_SHM_BYTES"] = shm
    import_first("deepspeed")
    r = cli("doctor", "--json", env=env)  # doctor reads them per check, in this process too
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    checks = {c["name"]: c for c in rows}
    assert len(checks) == len(rows), "two checks of one name"
    for name in DOCTOR:  # its own line, or the line of the check it feeds (DSKIT_IMAGE_ARCH: the ops)
        (fail,) = [c for c in rows if c["status"] == "FAIL" and name in f"{c['name']} {c['detail']}"]
        assert env_vars.VARIABLES[name].allowed in fail["detail"], fail
    assert checks["deepspeed"]["status"] == "PASS"  # the version stands beside the ops it cannot list
    assert {"python", "torch", "build locks", "launch contract"} <= set(checks)  # the others still ran


def _train(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dskit.train"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_the_trainer_refuses_a_launch_value_that_does_not_parse_in_one_line(tmp_path):
    """RANK, WORLD_SIZE and DSKIT_GPU_PROFILE as a launcher (or a hand-made job) may set them wrong:
    exit 2 and one line naming the variable, before any torch work; the exit code is still recorded for
    the launcher (DSKIT_EXIT_DIR), under the process id where RANK itself is what does not parse."""
    run = render_tiny(tmp_path, steps=1)
    exits = tmp_path / "exits"
    exits.mkdir()
    launch = {
        "DSKIT_RUN_FILE": str(run / "run.yaml"),
        "DSKIT_GPU_PROFILE": "cpu",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "DSKIT_EXIT_DIR": str(exits),
    }
    for name, value in [("RANK", "abc"), ("WORLD_SIZE", "two"), ("DSKIT_GPU_PROFILE", "h100")]:
        r = _train({**launch, name: value})
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.startswith(f"dskit: error: {name}: {value!r} is not ") and r.stderr.count("\n") == 1
    recorded = {p.name: p.read_text() for p in exits.iterdir()}
    assert recorded.pop("rank0") == "2\n"  # WORLD_SIZE's and the profile's
    assert list(recorded.values()) == ["2\n"] and list(recorded)[0].removeprefix("rank").isdigit()
