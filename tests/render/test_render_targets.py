"""Helm values and the Ray job: golden files (examples/), and the KubeRay RayJob's objects."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from dskit.launch.contract import RUN_YAML
from dskit.plan.build import build_plan
from dskit.render import TARGETS, ray
from dskit.spec import load_spec
from tests.support.golden_cases import TARGET_CASES, TARGET_GOLDEN, render_target_case

kubernetes_validate = pytest.importorskip("kubernetes_validate")
KUBE_VERSION = "1.34"  # as tests/render/test_helm.py

CASES = [(target, name) for target, cases in TARGET_CASES.items() for name in sorted(cases)]


@pytest.mark.parametrize("target,case", CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_golden(target, case):
    got = render_target_case(target, case)
    want_dir = TARGET_GOLDEN / target / case
    assert sorted(got) == sorted(p.name for p in want_dir.iterdir()), (
        "file set changed: python -m tests.support.regen_examples"
    )
    for rel, text in got.items():
        assert text == (want_dir / rel).read_text(), (
            f"examples/{target}/{case}/{rel} differs: review, then python -m tests.support.regen_examples"
        )


def _rayjob(*sets: str) -> tuple[object, dict[str, dict]]:
    plan = build_plan(load_spec(None, list(sets), {"hardware.nodes": 2, "hardware.gpu": "h100-80gb"}))
    files = TARGETS["ray"].render(plan, Path("/runs/r"))
    docs = list(yaml.safe_load_all(files[ray.RAYJOB]))
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), "one object of each kind"
    return plan, kinds


def _claims(job: dict) -> set[str]:
    cluster = job["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    return {
        v["persistentVolumeClaim"]["claimName"]
        for t in templates
        for v in t["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }


def test_rayjob_mounts_the_claim_it_creates():
    plan, kinds = _rayjob("kubernetes.storage_size=2Ti", "kubernetes.storage_class=nfs")
    assert set(kinds) == {"ConfigMap", "PersistentVolumeClaim", "RayJob"}
    pvc = kinds["PersistentVolumeClaim"]
    assert _claims(kinds["RayJob"]) == {pvc["metadata"]["name"]}
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "2Ti"}},
        "storageClassName": "nfs",
    }
    for obj in (kinds["ConfigMap"], pvc):
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    assert kinds["ConfigMap"]["data"][RUN_YAML] == TARGETS["ray"].render(plan, Path("/r"))[RUN_YAML]
    workers = kinds["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert [w["replicas"] for w in workers] == [plan.hardware.nodes]


def test_rayjob_mounts_the_existing_claim_the_spec_names():
    _, kinds = _rayjob("kubernetes.existing_claim=team-ckpt")
    assert set(kinds) == {"ConfigMap", "RayJob"}
    assert _claims(kinds["RayJob"]) == {"team-ckpt"}


def test_the_charts_launch_script_is_generated_from_the_shared_template():
    """launch.sh and job.sbatch share their stop/reap logic (templates/shell/stop.sh.j2)."""
    from dskit.render import helm

    assert (helm.chart_dir() / helm.LAUNCH_SCRIPT).read_text() == helm.launch_script(), (
        "helm/dskit/files/launch.sh is stale: python -m tests.support.regen_examples"
    )


@pytest.mark.parametrize(
    ("codes", "want"),
    [
        ([75, 75], 75),  # every rank asked for a restart
        ([75], 75),  # the other rank was killed (a stopped one) and wrote nothing
        ([75, 1], 1),  # a crash is not turned into a requeue by its peers
        ([75, 74], 74),  # a full disk is not retried
        ([74, 2, 75], 2),  # bad input wins
        ([], 1),  # nothing written: torchrun's own status
    ],
)
def test_the_pods_entrypoint_exits_with_the_ranks_verdict(tmp_path, codes, want):
    """launch.sh runs a command that plays the ranks (each writes DSKIT_EXIT_DIR/rankN, as
    contract.record_exit does) and fails as torchrun would: its exit is contract.exit_verdict's."""
    from dskit.launch.contract import exit_verdict
    from dskit.render import helm

    script = tmp_path / "launch.sh"
    script.write_text(helm.launch_script())
    ranks = "".join(f'echo {c} > "$DSKIT_EXIT_DIR/rank{i}"; ' for i, c in enumerate(codes))
    stop, complete = tmp_path / "ckpt" / "STOP", tmp_path / "out" / "COMPLETE"
    r = subprocess.run(
        [
            "bash",
            str(script),
            str(stop),
            str(complete),
            "75",
            "2",
            "74",
            "--",
            "bash",
            "-c",
            f"{ranks}exit 1",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "DSKIT_EXIT_DIR": str(tmp_path / "exit")},
        timeout=60,
    )
    assert r.returncode == want, r.stdout + r.stderr
    assert (exit_verdict(set(codes)) or 1) == want  # the Python launchers' rule, the same
