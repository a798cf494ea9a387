"""Helm values and the Ray job: golden files (examples/), and the KubeRay RayJob's objects."""

from __future__ import annotations

import pytest

from tests.golden_cases import TARGET_CASES, TARGET_GOLDEN, render_target_case

CASES = [(target, name) for target, cases in TARGET_CASES.items() for name in sorted(cases)]


@pytest.mark.parametrize("target,case", CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_golden(target, case):
    got = render_target_case(target, case)
    want_dir = TARGET_GOLDEN / target / case
    assert sorted(got) == sorted(p.name for p in want_dir.iterdir()), (
        "file set changed: python -m tests.regen_examples"
    )
    for rel, text in got.items():
        assert text == (want_dir / rel).read_text(), (
            f"examples/{target}/{case}/{rel} differs: review, then python -m tests.regen_examples"
        )
