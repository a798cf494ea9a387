"""Property: every command `dskit render` and `dskit calibrate` suggest (their `next:`, `or:` and `then:`
lines) runs, pasted into a shell, exactly the command meant: the run directory (-o) and the calibration
file (under storage.output_dir) each one word, unchanged, whatever they hold.

Hypothesis draws hostile strings (tests/spec/test_hostile_property.py's: `$(...)`, quotes, `;`, spaces,
line breakers) into the run directory's name and the output dir for slurm, helm and ray (the targets
that print a command with those paths), through the real CLI. A string is refused (one line, exit 2) or
every suggested line, split as a shell splits it (shlex.split), is the intended argv; and run by bash
with stub `bash`, `dskit`, `helm` and `kubectl` that record their arguments, it hands them exactly those
words and runs nothing else (a `$(touch ...)` payload leaves no file).
DSKIT_PROPERTY_EXAMPLES lowers the example count as it does for the other property tests.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from dskit import cli
from tests.spec.test_hostile_property import hostile

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = min(150, int(os.environ.get("DSKIT_PROPERTY_EXAMPLES", "150")))
TARGETS = ("slurm", "helm", "ray")
SUGGESTION_LABELS = ("next", "or", "then")
#: records its name and arguments, NUL-separated, one file per call; runs nothing
STUB = '#!/bin/sh\nprintf "%s\\0" "${0##*/}" "$@" > "$STUB_LOG/$$"\n'
SPEC = {
    "name": "run",
    "hardware": {"gpu": "cpu", "gpus_per_node": 2, "nodes": 2},
    "network": {"fabric": "tcp"},
    "model": {"preset": "tiny-v2"},
    "training": {"seq_len": 128, "global_batch": 8},
    "runtime": {"kind": "none"},
}


def intended(command: str, target: str, run_dir: Path, output_dir: Path, spec: Path) -> list[list[str]]:
    """The commands a user should be handed, written out here (not read from dskit's registry): after a
    calibration, the plan of the same spec at the measured rates."""
    run = str(run_dir)
    release = "run" if command == "render" else f"run-calibrate-{target}"  # the plan's name
    steps = {
        "slurm": [["bash", f"{run}/submit.sh"], ["dskit", "status", run]],
        "helm": [["helm", "install", release, f"{run}/chart", "-f", f"{run}/values.yaml"]],
        "ray": [["bash", f"{run}/submit.sh"], ["kubectl", "apply", "-f", f"{run}/rayjob.yaml"]],
    }[target]
    if command == "calibrate":
        calibration = f"{output_dir}/calibration.json"
        steps.append(["dskit", "plan", str(spec), "--calibration", calibration, "--explain"])
    return steps


def suggested(stdout: str) -> list[list[str]]:
    """The suggested commands in a command's output, split as a shell splits them."""
    found = []
    for line in stdout.splitlines():
        label, sep, rest = line.partition(": ")
        if sep and label in SUGGESTION_LABELS:
            found.append(shlex.split(rest))
    return found


def pasted(line: str, work: Path) -> list[list[str]]:
    """What bash runs for `line`, as the argv each stub program received; the stubs are all it finds."""
    stubs, log = work / "stubs", work / "log"
    stubs.mkdir(exist_ok=True)
    log.mkdir(exist_ok=True)
    for name in ("bash", "dskit", "helm", "kubectl"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    env = {"PATH": str(stubs), "STUB_LOG": str(log)}
    r = subprocess.run(["/bin/bash", "-c", line], env=env, cwd=work, capture_output=True, text=True)
    assert r.returncode == 0, (line, r.stderr)
    calls = [
        f.read_bytes().decode("utf-8", "surrogateescape").split("\0")[:-1] for f in sorted(log.iterdir())
    ]
    for f in log.iterdir():
        f.unlink()
    return calls


def run_cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(args)
    return code, out.getvalue(), err.getvalue()


def check(command: str, target: str, name: str, out_name: str, work: Path) -> bool:
    """Render (or calibrate) into WORK/NAME with the output dir WORK/store/OUT_NAME; False if refused."""
    base = work.resolve()
    spec = dict(SPEC, storage={"root": f"{base}/store", "output_dir": f"{base}/store/{out_name}"})
    spec_file = base / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    run_dir = base / name
    code, stdout, stderr = run_cli([command, target, str(spec_file), "-o", str(run_dir)])
    if code != 0:
        assert code == 2 and stderr.count("\n") == 1 and stdout == "", stderr
        return False
    want = intended(command, target, run_dir, base / "store" / out_name, spec_file)
    assert suggested(stdout) == want, stdout
    lines = [
        ln.partition(": ")[2] for ln in stdout.splitlines() if ln.partition(": ")[0] in SUGGESTION_LABELS
    ]
    assert [call for ln in lines for call in pasted(ln, base)] == want
    assert not list(base.rglob("pwned*")), "a suggested command ran a payload"
    return True


#: a run directory's name: one path component (the property is about quoting, not path arithmetic)
component = hostile.filter(lambda s: "/" not in s and s not in (".", "..") and "\x00" not in s)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    command=st.sampled_from(("render", "calibrate")),
    target=st.sampled_from(TARGETS),
    name=component,
    out_name=component,
)
def test_every_suggested_command_is_the_intended_argv_whatever_the_paths_hold(
    command, target, name, out_name
):
    with tempfile.TemporaryDirectory() as d:
        accepted = check(command, target, name, out_name, Path(d))
        event(f"{command} {target}: {'printed' if accepted else 'refused'}")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("command", ["render", "calibrate"])
def test_a_payload_in_the_paths_is_printed_as_text_and_never_runs(command, target, tmp_path):
    """The case the property must reach, pinned: quotes, spaces and a `$(touch ...)` payload in both the
    run directory and the output dir (Ray refuses '$' in storage paths: its runtime_env expands it)."""
    out_name = "out 'q' \"d\" ;x" + ("" if target == "ray" else " $(touch pwned-out)")
    assert check(command, target, "run $(touch pwned-run) 'q' \"d\" `touch pwned-tick`", out_name, tmp_path)


@pytest.mark.parametrize(
    "word", ["a\nb", "\x1b[31mred\x07", "\u202eevil\u2028", "it's \\ $(touch pwned)", "\x85x\udc80"]
)
def test_a_word_with_a_line_break_or_control_stays_one_line_and_the_same_bytes(word, tmp_path):
    """A path dskit did not vet (a torch extension lock under TORCH_EXTENSIONS_DIR) may hold anything:
    the suggested command stays one line with no raw control character, and bash, given it in the C
    locale, hands the program exactly that path's bytes (an undecodable byte, U+DC80, as its byte)."""
    from dskit.io.text import command, first_unsafe

    line = command(["dskit", word])
    assert first_unsafe(line) is None
    assert pasted(line, tmp_path) == [["dskit", word]]


def test_the_plan_after_a_calibration_is_of_the_same_spec_given_by_flags(tmp_path):
    """Without a spec file, the suggested `dskit plan` repeats the flags and --set values as given
    (hostile ones included, each one word), so it plans what was calibrated."""
    from dskit.cli import build_parser
    from dskit.cli.args import spec_from_args

    given = ["--gpu", "cpu", "--gpus-per-node", "2", "--nodes", "2", "--model", "tiny-v2"]
    given += ["--set", "training.seq_len=128", "--set", "network.fabric=tcp"]
    given += ["--set", f"storage.root={tmp_path}/st ore $(id) 'q'"]
    code, stdout, stderr = run_cli(["calibrate", "slurm", *given, "-o", str(tmp_path / "cal")])
    assert code == 0, stderr
    (plan,) = [w for w in suggested(stdout) if w[:2] == ["dskit", "plan"]]
    assert plan[-3] == "--calibration" and plan[-1] == "--explain"
    parser = build_parser()
    again = parser.parse_args(plan[1:-3] + ["--explain"])
    first = parser.parse_args(["calibrate", "slurm", *given])
    assert spec_from_args(again) == spec_from_args(first)
