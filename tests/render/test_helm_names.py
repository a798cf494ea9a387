"""A JobSet's pods are named after the run (NAME-node-0-INDEX-xxxxx, at most 63 characters): a name that
leaves no room is refused with the limit of the name the user gives, also where the job's name is made
from it (`dskit calibrate helm`: NAME-calibrate...), and that limit is exact."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dskit.cli import main

JOBSET = ["--set", "kubernetes.workload=jobset"]


def _run(tmp_path: Path, command: list[str], name: str, capsys) -> tuple[int, str, Path]:
    out = tmp_path / f"out-{len(name)}"
    code = main([*command, "--job-name", name, *JOBSET, "-o", str(out)])
    return code, capsys.readouterr().err, out


@pytest.mark.parametrize(
    "command,which",
    [
        (["render", "helm"], r"'a+'"),
        (
            ["calibrate", "helm"],
            r"the calibration job's name 'a+(-calibrate[a-z-]*)' \(the run's name and '\1'\)",
        ),
    ],
    ids=["render", "calibrate"],
)
def test_a_name_too_long_for_the_jobsets_pods_is_refused_with_the_limit_of_the_name_given(
    tmp_path, capsys, command, which
):
    code, err, out = _run(tmp_path, command, "a" * 52, capsys)  # the longest name a spec takes
    assert code == 2 and not out.exists(), err
    line = re.fullmatch(
        rf"dskit: error: name: {which} cannot name a jobset: its pods are '[a-z-]+-node-0-0-xxxxx', which must "
        r"start with a letter and fit 63 characters: (?:give the run )?a name of at most (\d+) characters "
        r"starting with a letter\n",
        err,
    )
    assert line, err
    limit = int(line.groups()[-1])
    # the limit stated is the one that holds: at it the run renders, one character over it is refused
    code, err, out = _run(tmp_path, command, "a" * limit, capsys)
    assert code == 0 and out.is_dir(), err
    code, err, out = _run(tmp_path, command, "a" * (limit + 1), capsys)
    assert code == 2 and not out.exists() and f"at most {limit} characters" in err, err
