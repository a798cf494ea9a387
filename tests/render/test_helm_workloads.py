"""The chart's other workloads (kubernetes.workload: jobset, trainjob) and Kueue (kubernetes.queue, ...):
every catalog GPU x fabric rendered, linted, and validated strictly, the core kinds against Kubernetes'
schemas (kubernetes-validate) and the custom ones against their CRDs' (tests/crds,
tests/support/crd_schemas.py); the JobSet's failurePolicy read as its controller reads it; the
JobSet's pods run on two network-namespace hosts (tests/support/k8s_pods.py), preempted and restarted;
`dskit status` on a JobSet and a TrainJob; bad values refused in one line.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from dskit import catalog
from dskit.errors import EXIT_BAD_INPUT
from dskit.launch.contract import COMPLETE_FILE, EXIT_DISK_FULL, EXIT_REQUEUE
from dskit.plan.schema import load_plan
from dskit.render import helm as helm_render
from tests.conftest import REPO, render_tiny
from tests.render.test_helm import (
    CATALOG,
    CHART,
    KUBE_VERSION,
    RELEASE,
    by_kind,
    enum_violations,
    lint_problems,
    render_chart,
    steps_logged,
    values_for,
)
from tests.support import crd_schemas
from tests.support.cli import cli
from tests.support.k8s_pods import JobSetController, Pods, job_failure, jobset_action, jobset_child, wait_for

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (pip install -e .[test])")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
pytestmark = pytest.mark.helm

KUEUE = ["kubernetes.queue=team-a", "kubernetes.queue_priority=high"]
WORKLOAD = {"jobset": "JobSet", "trainjob": "TrainJob"}


def as_job(name: str, spec: dict) -> dict:
    """A Job spec inside a custom resource, as the Job its controller creates (for the core schemas)."""
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": spec}


def rendered(kind: str, *sets: str, **kw) -> tuple[dict, dict]:
    values = values_for(f"kubernetes.workload={kind}", *sets, **kw)
    return values, by_kind(render_chart(values))


# --------------------------------------------------------------------------- every GPU x fabric


@pytest.mark.parametrize("gpu,fabric", CATALOG, ids=[f"{g}-{f}" for g, f in CATALOG])
def test_every_catalog_combination_as_jobset_and_trainjob_lints_and_validates_strictly(gpu, fabric):
    per_node = 2 if gpu == "cpu" else 8
    # a topology request where the fabric names a level; the CPU plan resolves RDMA fabrics to tcp
    topology = ["kubernetes.topology=preferred"]
    if gpu == "cpu" or not catalog.fabric(fabric).k8s_topology_level:
        topology.append("kubernetes.topology_level=cloud.provider.com/topology-rack")
    for kind, crd_kind in WORKLOAD.items():
        values, kinds = rendered(kind, *KUEUE, *topology, gpu=gpu, fabric=fabric, per_node=per_node)
        assert lint_problems(values) == []
        assert set(kinds) == {"ConfigMap", "PersistentVolumeClaim", crd_kind}, "no Job, no Service of ours"
        for obj in (kinds["ConfigMap"], kinds["PersistentVolumeClaim"]):
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        workload = kinds[crd_kind]
        assert crd_schemas.problems(workload, kind) == []
        assert workload["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert workload["spec"]["suspend"] is True
        if kind == "jobset":
            (rjob,) = workload["spec"]["replicatedJobs"]
            child = as_job(f"{RELEASE}-node-0", rjob["template"]["spec"])
            kubernetes_validate.validate(child, KUBE_VERSION, strict=True)  # the pods, by the core schemas
            assert enum_violations(child) == []
        else:
            # the TrainJob's CEL rule on its name (RFC 1035), which the schema file cannot check
            name = workload["metadata"]["name"]
            assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63


def test_the_crd_validation_is_strict():
    """Fields the API server would prune, bad label values and int32 overflows fail."""
    _, kinds = rendered("jobset")
    jobset = kinds["JobSet"]
    assert crd_schemas.problems(jobset, "jobset") == []
    cases = {
        "unknown spec field": lambda o: o["spec"].update(replicas=2),
        "unknown pod field": lambda o: o["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
            "spec"
        ].update(hostname2="x"),
        "label value": lambda o: o["metadata"]["labels"].update({"kueue.x-k8s.io/queue-name": "a b"}),
        "int32": lambda o: o["spec"]["failurePolicy"].update(maxRestarts=2**31),
        "enum": lambda o: o["spec"]["failurePolicy"]["rules"][0].update(action="Retry"),
        "kind": lambda o: o.update(kind="JobSets"),
    }
    for case, mutate in cases.items():
        bad = copy.deepcopy(jobset)
        mutate(bad)
        assert crd_schemas.problems(bad, "jobset"), case


# --------------------------------------------------------------------------- Kueue


@pytest.mark.parametrize("kind", ["job", "jobset", "trainjob"])
def test_a_queue_labels_the_workload_suspends_it_and_asks_for_topology(kind):
    values, kinds = rendered(
        kind, *KUEUE, "kubernetes.topology=required", gpu="h100-80gb", fabric="efa", per_node=8
    )
    (workload,) = [o for o in kinds.values() if o["kind"] in ("Job", "JobSet", "TrainJob")]
    labels = workload["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
    assert labels["kueue.x-k8s.io/priority-class"] == "high"
    assert workload["spec"]["suspend"] is True
    if kind == "job":
        pod = workload["spec"]["template"]
    elif kind == "jobset":
        pod = workload["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    else:
        pod = workload["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
        pod = pod["replicatedJobs"][0]["template"]["spec"]["template"]
    # the catalog's level for EFA (dskit/catalog/fabrics.yaml), on the pods Kueue places
    level = catalog.fabric("efa").k8s_topology_level
    assert pod["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == level
    assert "kueue.x-k8s.io/queue-name" not in pod["metadata"]["labels"], (
        "the workload is queued, not each pod"
    )


def test_without_the_new_fields_the_job_and_values_are_what_they_were():
    plain = values_for()
    assert not {"workload", "kueue", "trainJob"} & set(plain), "values.yaml gains no keys"
    kube = yaml.safe_load(plain["plan"])["kubernetes"]
    assert not {"workload", "queue", "queue_priority", "topology", "topology_level"} & set(kube)
    explicit = {**plain, "workload": "job", "kueue": {"queueName": ""}, "trainJob": {}}
    assert render_chart(plain) == render_chart(explicit)
    job = by_kind(render_chart(plain))["Job"]
    assert "suspend" not in job["spec"] and not any("kueue" in k for k in job["metadata"]["labels"])
    assert set(job["spec"]["template"]["metadata"]["annotations"]) == {"dskit.io/config-checksum"}


def test_kueue_example_objects_validate_against_the_kueue_crds():
    """examples/kueue/queues.yaml: the cluster side the worked examples submit to."""
    objs = [o for o in yaml.safe_load_all((REPO / "examples" / "kueue" / "queues.yaml").read_text()) if o]
    schema = {
        "LocalQueue": "kueue-localqueues",
        "ClusterQueue": "kueue-clusterqueues",
        "ResourceFlavor": "kueue-resourceflavors",
        "Topology": "kueue-topologies",
        "WorkloadPriorityClass": "kueue-workloadpriorityclasses",
    }
    assert {o["kind"] for o in objs} == set(schema)
    for obj in objs:
        assert crd_schemas.problems(obj, schema[obj["kind"]]) == [], obj["kind"]
    kinds = {o["kind"]: o for o in objs}
    spec = yaml.safe_load((REPO / "examples" / "helm" / "v3-h200-jobset-kueue" / "values.yaml").read_text())
    assert spec["kueue"]["queueName"] == kinds["LocalQueue"]["metadata"]["name"]
    assert spec["kueue"]["priorityClass"] == kinds["WorkloadPriorityClass"]["metadata"]["name"]
    levels = [lv["nodeLabel"] for lv in kinds["Topology"]["spec"]["levels"]]
    assert spec["kueue"]["topologyLevel"] in levels


# --------------------------------------------------------------------------- JobSet


def test_jobset_failure_policy_maps_the_trainers_exit_codes():
    """As today's podFailurePolicy: 2 and 74 fail, 75 and disruptions restart without counting, the
    rest restart counted against failure.maxRestarts (tests/support/k8s_pods.py reads the policy as
    the Job and JobSet controllers do)."""
    _, kinds = rendered("jobset")
    jobset = kinds["JobSet"]
    job = jobset_child(copy.deepcopy(jobset))

    def action(code: int, disrupted: bool = False) -> str:
        failure = job_failure(job, f"{RELEASE}-node-0-1-abcde", code, disrupted=disrupted, counted=0)
        assert failure is not None, "the child Job fails at the first failed pod"
        return jobset_action(jobset, *failure)[1]

    assert action(EXIT_BAD_INPUT) == action(EXIT_DISK_FULL) == "FailJobSet"
    assert action(EXIT_REQUEUE) == "RestartJobSetAndIgnoreMaxRestarts"
    assert action(-9, disrupted=True) == "RestartJobSetAndIgnoreMaxRestarts"  # node lost
    assert action(1) == action(22) == action(137) == "RestartJobSet"
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 3
    assert jobset["spec"]["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    # the hostnames rank 0's rendezvous needs: pod i is NAME-node-0-i.NAME
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == f"{RELEASE}-node-0-0.{RELEASE}"
    assert pod["initContainers"][0]["command"][-2:] == [f"{RELEASE}-node-0-{i}.{RELEASE}" for i in (0, 1)]
    assert jobset["spec"]["network"] == {
        "enableDNSHostnames": True,
        "subdomain": RELEASE,
        "publishNotReadyAddresses": True,
    }


def test_trainjob_runs_dskits_launcher_with_the_jobs_contract():
    values, kinds = rendered("trainjob", gpu="h100-80gb", fabric="infiniband", per_node=8)
    trainer = kinds["TrainJob"]["spec"]["trainer"]
    job_values = dict(values, workload="job")
    (container,) = by_kind(render_chart(job_values))["Job"]["spec"]["template"]["spec"]["containers"]
    # the gang wait, then the launcher and torchrun exactly as the Job's pods run them
    assert trainer["command"][:6] == [
        "bash",
        "/etc/dskit/gang-start.sh",
        "900",
        f"{RELEASE}-node-0",
        "2",
        RELEASE,
    ]
    assert trainer["command"][6:] == ["--", *container["command"]]
    assert trainer["args"] == container["args"]
    env = {e["name"]: e for e in trainer["env"]}
    assert (
        env["MASTER_ADDR"]["value"] == f"{RELEASE}-node-0-0.{RELEASE}"
    )  # the torch plugin's PET_MASTER_ADDR form
    assert [e for e in trainer["env"] if e["name"] != "MASTER_ADDR"] == [
        e for e in container["env"] if e["name"] != "MASTER_ADDR"
    ]
    assert not [n for n in env if n.startswith("PET_")], "the torch plugin refuses its reserved names"
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 8
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    assert kinds["ConfigMap"]["data"]["gang-start.sh"] == (CHART / "files" / "gang-start.sh").read_text()


def test_gang_start_waits_for_every_pod_then_runs_the_launcher(tmp_path):
    script = str(CHART / "files" / "gang-start.sh")
    ok = subprocess.run(
        ["bash", script, "5", "p", "0", "d", "--", "echo", "launched"], capture_output=True, text=True
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "launched"
    r = subprocess.run(
        ["bash", script, "1", "dskit-no-such-pod", "1", "invalid", "--", "echo", "launched"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "launched" not in r.stdout
    assert "dskit-no-such-pod-0.invalid did not resolve within 1s" in r.stderr
    assert subprocess.run(["bash", script, "5", "p", "1"], capture_output=True).returncode == 2


# --------------------------------------------------------------------------- bad values


HOSTILE = {
    "kubernetes.queue": ["Team A", "a;rm -rf /", "$(id)", "x" * 64, "-a"],
    "kubernetes.queue_priority": ["High", "a/b"],
    "kubernetes.topology_level": ["rack level", "a/b/c", "$(x)"],
    "kubernetes.topology": ["always"],
    "kubernetes.workload": ["deployment"],
}
HOSTILE_CASES = [(f, v) for f, vs in HOSTILE.items() for v in vs]


@pytest.mark.parametrize("field,value", HOSTILE_CASES, ids=[f"{f}={v[:12]}" for f, v in HOSTILE_CASES])
def test_hostile_values_in_the_new_fields_are_one_line_exit_2_nothing_written(tmp_path, field, value):
    sets = ["kubernetes.queue=q", "kubernetes.topology=preferred"] if "topology" in field else []
    out = tmp_path / "o"
    r = cli("render", "helm", "--gpu", "h100-80gb", *[a for s in sets for a in ("--set", s)],
              "--set", f"{field}={json.dumps(value)}", "-o", str(out))  # fmt: skip
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and field in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "sets,field",
    [
        (["kubernetes.queue_priority=high"], "kubernetes.queue"),
        (["kubernetes.queue=q", "kubernetes.topology=required"], "kubernetes.topology_level"),  # tcp: none
        (["kubernetes.workload=jobset", "name=" + "a" * 50], "name"),
        (["kubernetes.workload=trainjob", "name=7b-run"], "name"),
        # what a TrainJob's runtime cannot carry is refused, not dropped (docs/targets.md)
        (["kubernetes.workload=trainjob", "kubernetes.priority_class=high"], "kubernetes.priority_class"),
        (["kubernetes.workload=trainjob", "kubernetes.max_restarts=5"], "kubernetes.max_restarts"),
    ],
)
def test_combinations_the_workload_cannot_take_are_refused(tmp_path, sets, field):
    out = tmp_path / "o"
    r = cli("render", "helm", "--gpu", "cpu", *[a for s in sets for a in ("--set", s)], "-o", str(out))
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and field in r.stderr, r.stderr
    assert not out.exists()


# --------------------------------------------------------------------------- the JobSet's pods, run


@pytest.mark.train
def test_jobset_pods_train_across_two_hosts_and_restart_after_preemption(tmp_path, pod_hosts):
    """The JobSet's pods (its child Job NAME-node-0, hostnames NAME-node-0-i in the JobSet's subdomain)
    on two network-namespace hosts. Pod 1 is preempted: it and its peer checkpoint and exit 75, the
    child Job fails by its podFailurePolicy, and the JobSet's rule restarts the group without counting
    it; the new pods resume and complete."""
    root = tmp_path / "js"
    run_dir = render_tiny(
        root, name=RELEASE, target="helm", steps=24, nodes=2, gpus_per_node=1,
        extra=["checkpoint.every=4", "network.interface=eth0", "kubernetes.workload=jobset"],
    )  # fmt: skip
    plan = load_plan(run_dir / "run.yaml")
    values = yaml.safe_load((run_dir / helm_render.VALUES).read_text())
    kinds = by_kind(render_chart(values, run_dir / helm_render.CHART))
    jobset = kinds["JobSet"]
    job = jobset_child(copy.deepcopy(jobset))
    pods = Pods(root / "pods", job, {kinds["ConfigMap"]["metadata"]["name"]: kinds["ConfigMap"]},
                {f"{RELEASE}-storage": str(root / "storage")}, prefix="dkj", net="192.168.215")  # fmt: skip
    pods.base.mkdir()
    try:
        pods.up()
        pods.publish([0, 1])
        ctl = JobSetController(pods, jobset)
        done = threading.Thread(target=ctl.run, args=(600,), daemon=True)
        done.start()
        wait_for(lambda: max(steps_logged(pods), default=0) >= 6, 240, "step 6", pods)
        ctl.preempt(1)
        done.join(600)
    finally:
        pods.down()
    assert ctl.result == "Completed", (ctl.history, pods.logs())
    (first, *_) = ctl.history
    assert first[2] == EXIT_REQUEUE and first[3:] == ("PodFailurePolicy", "CheckpointedOrDisrupted",
                                                     "RestartJobSetAndIgnoreMaxRestarts")  # fmt: skip
    assert ctl.restarts == len(ctl.history) and ctl.counted == 0
    assert sorted(set(steps_logged(pods))) == list(range(1, 25)), "every step logged, none lost"
    assert Path(plan.run.output_dir, COMPLETE_FILE).exists()
    assert "resumed from" in pods.log(0)
    assert f"rank 0 of 2 on {RELEASE}-node-0-0" in pods.log(
        0
    ) and f"rank 1 of 2 on {RELEASE}-node-0-1" in pods.log(1)


# --------------------------------------------------------------------------- dskit status


def _status(monkeypatch, capsys, tmp_path, kind: str, custom: list[dict], pods: list[dict]) -> str:
    """`dskit status RUN_DIR` of a run rendered for `kind`, against stand-in Kubernetes clients that
    answer the given objects (no kube-apiserver here), read through the client's own models."""
    pytest.importorskip("kubernetes")
    from types import SimpleNamespace as NS

    from kubernetes.client import ApiClient

    from dskit import cli
    from dskit.status import k8s

    rd = render_tiny(tmp_path, name="big", steps=40, target="helm", extra=[f"kubernetes.workload={kind}"])
    asked = []

    class Api:
        def list_namespaced_job(self, namespace, label_selector, _request_timeout):
            return NS(items=[])

        def list_namespaced_pod(self, namespace, label_selector, _request_timeout):
            return NS(items=[ApiClient()._ApiClient__deserialize(p, "V1Pod") for p in pods])

        def list_namespaced_custom_object(
            self, group, version, namespace, plural, label_selector, _request_timeout
        ):
            asked.append((group, version, plural, label_selector))
            return {"items": custom}

    monkeypatch.setattr(k8s, "_clients", lambda kubeconfig, context: (Api(), Api()))
    monkeypatch.setattr(k8s, "_custom_api", Api)
    assert cli.main(["status", str(rd)]) == 0
    assert [a[2] for a in asked] == [f"{kind}s"]
    assert asked[0][3] == "app.kubernetes.io/name=dskit,app.kubernetes.io/instance=big"
    return capsys.readouterr().out


def _pod(index: int, attempt: int, container: str, code: int | None) -> dict:
    state = {"running": {}} if code is None else {"terminated": {"exitCode": code, "reason": "Error"}}
    return {
        "metadata": {"name": f"big-node-0-{index}-{attempt}x", "creationTimestamp": f"2026-12-04T10:0{attempt}:00Z",
                     "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}},
        "spec": {"containers": [{"name": container}], "nodeName": f"gpu-{index}"},
        "status": {"phase": "Running" if code is None else "Failed",
                   "containerStatuses": [{"name": container, "state": state, "ready": False, "restartCount": 0,
                                          "image": "i", "imageID": ""}]},
    }  # fmt: skip


def test_status_of_a_jobset_gives_its_state_restarts_and_the_verdict(monkeypatch, capsys, tmp_path):
    jobset = {
        "metadata": {"name": "big"},
        "spec": {"failurePolicy": {"maxRestarts": 3}},
        "status": {"restarts": 2, "restartsCountTowardsMax": 1,
                   "conditions": [{"type": "Failed", "status": "True", "reason": "FailJobSetFailurePolicyAction",
                                   "message": "applying FailJobSet failure policy action"}]},
    }  # fmt: skip
    pods = [
        _pod(0, 1, "trainer", EXIT_REQUEUE),
        _pod(0, 2, "trainer", EXIT_BAD_INPUT),
        _pod(1, 2, "trainer", 1),
    ]
    out = _status(monkeypatch, capsys, tmp_path, "jobset", [jobset], pods).splitlines()
    assert out[0] == (
        "jobset big: Failed (FailJobSetFailurePolicyAction: applying FailJobSet failure policy action); "
        "restarts 2 (1 counted of maxRestarts 3)"
    )
    assert (
        out[1] == f"verdict: bad input (exit {EXIT_BAD_INPUT}): a retry cannot help"
    )  # the latest attempt's
    assert out[2].split()[:2] == ["RANK-INDEX", "ATTEMPTS"]


def test_status_of_a_trainjob_gives_its_conditions_and_the_verdict(monkeypatch, capsys, tmp_path):
    trainjob = {"metadata": {"name": "big"}, "spec": {"suspend": True}, "status": {}}
    out = _status(monkeypatch, capsys, tmp_path, "trainjob", [trainjob], []).splitlines()
    assert out[0] == "trainjob big: suspended"
    trainjob["status"] = {"conditions": [{"type": "Complete", "status": "True", "reason": "JobsCompleted",
                                          "message": "\x1b[31mdone"}]}  # fmt: skip
    pods = [_pod(i, 1, "node", 0) for i in (0, 1)]  # the torch runtime's container name
    out = _status(monkeypatch, capsys, tmp_path / "again", "trainjob", [trainjob], pods).splitlines()
    assert out[0].startswith("trainjob big: Complete (JobsCompleted: ") and "\x1b" not in out[0]
    assert out[1] == "verdict: completed (exit 0 on every pod)"


def test_render_helm_writes_the_jobset_and_says_how_to_submit_it(tmp_path):
    out = tmp_path / "run-js"
    r = cli("render", "helm", "--nodes", "2", "--set", f"storage.root={tmp_path}/s",
              "--set", "kubernetes.workload=jobset", "-o", str(out), check=True)  # fmt: skip
    assert f"helm install dskit-run {out / 'chart'} -f {out / 'values.yaml'}" in r.stdout
    values = yaml.safe_load((out / "values.yaml").read_text())
    assert values["workload"] == "jobset" and lint_problems(values, out / "chart") == []
    assert shutil.which("bash")


@pytest.mark.parametrize("refusal", [403, 404])
def test_status_of_a_bare_release_skips_the_kinds_it_may_not_list(monkeypatch, refusal):
    """`dskit status RELEASE` asks about every kind; a Role for Jobs and pods only (403), or a cluster
    without the CRDs (404), must still get the Job's status, not an error about JobSets."""
    pytest.importorskip("kubernetes")
    from types import SimpleNamespace as NS

    from kubernetes.client import ApiClient
    from kubernetes.client.exceptions import ApiException

    from dskit.status import k8s

    job = {
        "metadata": {"name": "big", "labels": {"app.kubernetes.io/instance": "big"}},
        "spec": {"completions": 2, "parallelism": 2, "template": {"spec": {"containers": []}}},
        "status": {"active": 2},
    }

    class Api:
        def list_namespaced_job(self, namespace, label_selector, _request_timeout):
            return NS(items=[ApiClient()._ApiClient__deserialize(job, "V1Job")])

        def list_namespaced_pod(self, namespace, label_selector, _request_timeout):
            return NS(items=[])

        def list_namespaced_custom_object(
            self, group, version, namespace, plural, label_selector, _request_timeout
        ):
            raise ApiException(status=refusal, reason="Forbidden" if refusal == 403 else "Not Found")

    monkeypatch.setattr(k8s, "_clients", lambda kubeconfig, context: (Api(), Api()))
    monkeypatch.setattr(k8s, "_custom_api", Api)
    assert k8s.status_text("big", "default").startswith("job big")
