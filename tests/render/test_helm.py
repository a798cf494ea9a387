"""The Helm chart (helm/dskit) and `dskit render helm`, with the real Helm engine (helm-python-sdk, Helm
v4's Go SDK) and the Kubernetes OpenAPI schemas (kubernetes-validate, strict), for every catalog GPU x
fabric; the contract against the Slurm render of the same plan; and the rendered pods run as processes
on two network-namespace hosts (tests/support/k8s_pods.py), training across them.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from dskit import catalog
from dskit.calibrate import calibration
from dskit.errors import EXIT_BAD_INPUT
from dskit.launch.contract import COMPLETE_FILE, EXIT_DISK_FULL, EXIT_REQUEUE, REQUIRED
from dskit.plan.build import build_plan
from dskit.plan.schema import load_plan
from dskit.render import helm as helm_render
from dskit.render import ray, slurm
from dskit.render.helm_values import ChartValues, values_schema_json
from dskit.spec import load_spec
from dskit.train.entry import LAUNCH_ENV_FILE
from tests.conftest import REPO, render_tiny, slurm_launch
from tests.render.test_render_slurm import SHELLCHECK
from tests.support.cli import cli
from tests.support.k8s_pods import JobController, Pods, container_env, expand, failure_action, wait_for

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (pip install -e .[test])")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
pytestmark = pytest.mark.helm
helm.disable_logging()

CHART = REPO / "helm" / "dskit"
KUBE_VERSION = "1.34"
RELEASE = "run"


# --------------------------------------------------------------------------- helpers


def values_for(*sets: str, gpu: str = "cpu", fabric: str = "tcp", nodes: int = 2, per_node: int = 2) -> dict:
    flags = {"hardware.gpu": gpu, "network.fabric": fabric, "hardware.nodes": nodes}
    flags["hardware.gpus_per_node"] = per_node
    plan = build_plan(load_spec(None, ["storage.root=/shared/dskit", *sets], flags))
    return yaml.safe_load(helm_render.values_yaml(plan))


def render_chart(values: dict, chart: Path = CHART, name: str = RELEASE) -> list[dict]:
    """All objects the chart renders for `values` (NOTES.txt excluded), parsed."""
    with helm.Chart.load(str(chart)) as ch:
        out = ch.render(values, name=name, namespace="default", is_install=True)
    objs = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            objs += [d for d in yaml.safe_load_all(text) if d]
    return objs


def by_kind(objs: list[dict]) -> dict[str, dict]:
    kinds: dict[str, dict] = {}
    for o in objs:
        assert o["kind"] not in kinds, f"two {o['kind']} objects"
        kinds[o["kind"]] = o
    return kinds


def lint_problems(values: dict, chart: Path = CHART) -> list[str]:
    """Lint findings above INFO (strict mode)."""
    res = helm.lint(str(chart), values, strict=True, kube_version=f"v{KUBE_VERSION}.0")
    return [f"{m['path']}: {m['error']}" for m in res["messages"] if m["severity"] > 1] + list(res["errors"])


# Enum-valued fields the OpenAPI schemas leave open (kubernetes-validate accepts any string there).
ENUMS = {
    ("Job", "completionMode"): {"Indexed", "NonIndexed"},
    ("Job", "podReplacementPolicy"): {"Failed", "TerminatingOrFailed"},
    ("Job", "restartPolicy"): {"Never", "OnFailure"},
    ("Job", "action"): {"FailJob", "FailIndex", "Ignore", "Count"},
    ("Job", "operator"): {"In", "NotIn", "Equal", "Exists"},
    ("Job", "medium"): {"", "Memory"},
    ("Job", "imagePullPolicy"): {"Always", "IfNotPresent", "Never"},
    ("Job", "protocol"): {"TCP", "UDP", "SCTP"},
    ("Job", "effect"): {"NoSchedule", "PreferNoSchedule", "NoExecute"},
    ("Service", "protocol"): {"TCP", "UDP", "SCTP"},
    ("PersistentVolumeClaim", "accessModes"): {
        "ReadWriteMany",
        "ReadWriteOnce",
        "ReadOnlyMany",
        "ReadWriteOncePod",
    },
}


def enum_violations(obj: dict) -> list[str]:
    bad = []

    def walk(node, key=None):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        else:
            allowed = ENUMS.get((obj["kind"], key))
            if allowed is not None and node not in allowed:
                bad.append(f"{obj['kind']}.{key}={node!r} not in {sorted(allowed)}")

    walk(obj)
    return bad


def job_parts(objs: list[dict]) -> tuple[dict, dict, dict]:
    kinds = by_kind(objs)
    job = kinds["Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return job, container, kinds


def pod_env(container: dict) -> dict[str, str]:
    labels = {"batch.kubernetes.io/controller-uid": "uid-1"}
    return container_env(container, labels=labels, secrets={})


# --------------------------------------------------------------------------- the chart itself


def test_chart_lints_clean_with_its_own_defaults():
    assert lint_problems({}) == []


def test_values_schema_is_generated_from_the_values_model():
    assert (CHART / "values.schema.json").read_text() == values_schema_json(), (
        "helm/dskit/values.schema.json is stale: python -m tests.support.regen_examples"
    )
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(defaults, json.loads(values_schema_json()))
    # every value the model knows is documented in the chart's values.yaml, and nothing else is there
    assert set(defaults) == {f.alias for f in ChartValues.model_fields.values()}


def test_chart_refuses_install_without_a_plan():
    with pytest.raises(helm.HelmRenderError, match="dskit render helm"):
        render_chart({})


CATALOG = [(g, f) for g in sorted(catalog.gpus()) for f in sorted(catalog.fabrics())]


@pytest.mark.parametrize("gpu,fabric", CATALOG, ids=[f"{g}-{f}" for g, f in CATALOG])
def test_every_catalog_combination_lints_renders_and_validates_strictly(gpu, fabric):
    per_node = 2 if gpu == "cpu" else 8
    values = values_for(gpu=gpu, fabric=fabric, per_node=per_node)
    assert lint_problems(values) == []
    objs = render_chart(values)
    assert {o["kind"] for o in objs} == {"ConfigMap", "Service", "Job", "PersistentVolumeClaim"}
    for obj in objs:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        assert enum_violations(obj) == []

    job, container, kinds = job_parts(objs)
    plan = yaml.safe_load(values["plan"])
    fab = catalog.fabric(plan["launch"]["fabric"])
    # a CPU plan has no RDMA device: whatever the fabric asked, it runs on tcp (no rdma/*, no IPC_LOCK)
    assert fab.name == ("tcp" if gpu == "cpu" and catalog.fabric(fabric).rdma else fabric)
    limits = container.get("resources", {}).get("limits", {})
    assert limits.get("nvidia.com/gpu") == (per_node if gpu != "cpu" else None)
    assert limits.get(fab.k8s_resource or "-") == (1 if fab.rdma else None)
    (init,) = job["spec"]["template"]["spec"]["initContainers"]
    for c in (container, init):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    caps = container["securityContext"]["capabilities"].get("add", [])
    assert caps == (["IPC_LOCK"] if fab.rdma else []), "IPC_LOCK only where RDMA needs it"
    assert "add" not in init["securityContext"]["capabilities"]
    assert "securityContext" not in job["spec"]["template"]["spec"]  # root unless the values ask
    shm = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": str(plan["launch"]["shm_bytes"])}
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert kinds["Service"]["spec"]["clusterIP"] == "None"
    assert kinds["Service"]["spec"]["publishNotReadyAddresses"] is True
    assert kinds["ConfigMap"]["data"]["run.yaml"] == values["plan"]


BAD_VALUES = {
    "zero nodes": (lambda v: v.update(nodes=0), "/nodes"),
    "unknown key": (lambda v: v.update(replicas=2), "additional properties 'replicas'"),
    "wrong type": (lambda v: v.update(nodes="two"), "/nodes"),
    "pull policy": (lambda v: v["image"].update(pullPolicy="Sometimes"), "/image/pullPolicy"),
    "toleration effect": (
        lambda v: v.update(tolerations=[{"key": "a", "effect": "NoRun"}]),
        "/tolerations/0/effect",
    ),
    "env name": (lambda v: v["trainer"]["env"].update({"BAD-NAME": "1"}), "/trainer/env"),
    "shm size": (lambda v: v["shm"].update(sizeLimit="lots"), "/shm/sizeLimit"),
    "inline secret": (
        lambda v: v["trainer"]["secretEnv"].append({"name": "T", "value": "x"}),
        "/trainer/secretEnv/0",
    ),
    "claim name": (lambda v: v["storage"].update(existingClaim="Not_A_Name"), "/storage/existingClaim"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_values_schema_rejects_bad_values_at_install(case):
    mutate, where = BAD_VALUES[case]
    values = values_for()
    mutate(values)
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        render_chart(values)
    assert lint_problems(values), "lint must report it too"


def test_chart_refuses_values_that_disagree_with_the_plan():
    values = values_for()
    values["nodes"] = 3
    with pytest.raises(helm.HelmRenderError, match="nodes is 3 but the plan is for 2 nodes"):
        render_chart(values)


# --------------------------------------------------------------------------- contract with Slurm


def test_pod_env_command_and_rendezvous_equal_the_slurm_and_ray_renders(tmp_path):
    sets = [
        "storage.root=/shared/dskit",
        "network.interface=ib0",
        "runtime.kind=none",
        "runtime.python=/venv/bin/python",
    ]
    plan = build_plan(load_spec(None, sets, {"hardware.nodes": 2, "hardware.gpu": "h100-80gb"}))
    s_env, s_argv = slurm_launch(slurm.render(plan, tmp_path / "s")[slurm.SCRIPT], tmp_path)
    values = yaml.safe_load(helm_render.values_yaml(plan))
    job, container, kinds = job_parts(render_chart(values))
    k_env = pod_env(container)
    k_argv = [expand(w, k_env) for w in container["args"]]

    r_env = ray.runtime_env(plan)["env_vars"]
    contract = [*REQUIRED, *plan.env]
    differs = {n for n in contract if s_env.get(n) != k_env.get(n)}
    assert differs == {"DSKIT_RUN_FILE"}, "only the run file's path may differ"
    assert {n for n in contract if r_env.get(n) != k_env.get(n)} == {"DSKIT_RUN_FILE"}, "Ray: the same"
    assert (tmp_path / "s").exists() is False  # render() returns files; nothing written
    assert kinds["ConfigMap"]["data"]["run.yaml"] == slurm.render(plan, tmp_path / "s")["run.yaml"]
    assert k_env["DSKIT_RUN_FILE"] == helm_render.run_file_path()

    srun_end = s_argv.index(plan.launch.python)
    assert s_argv[srun_end:] == [
        w.replace(f"{RELEASE}-0.{RELEASE}:", "node1:").replace("uid-1", "7") for w in k_argv
    ]
    assert f"--rdzv-endpoint={RELEASE}-0.{RELEASE}:{plan.launch.rdzv_port}" in k_argv
    assert kinds["Service"]["spec"]["ports"][0]["port"] == plan.launch.rdzv_port


def test_pods_can_run_as_non_root_through_values():
    values = values_for()
    values["podSecurityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
    }
    assert lint_problems(values) == []
    job, _, _ = job_parts(render_chart(values))
    assert job["spec"]["template"]["spec"]["securityContext"] == values["podSecurityContext"]
    values["podSecurityContext"] = {"privileged": True}
    assert lint_problems(values), "the schema admits only the non-root settings"


def test_contract_paths_with_dollar_reach_the_entrypoint_literally():
    root = "/shared/dskit/$(MASTER_ADDR)/$$x"
    values = values_for(f"storage.root={root}")
    _, container, _ = job_parts(render_chart(values))
    env = pod_env(container)
    argv = [expand(w, env) for w in container["command"]]
    assert argv[2] == f"{root}/dskit-run/checkpoints/STOP" == f"{env['DSKIT_CHECKPOINT_DIR']}/STOP"
    assert argv[3] == f"{root}/dskit-run/outputs/COMPLETE" == f"{env['DSKIT_OUTPUT_DIR']}/COMPLETE"


def test_hostile_strings_reach_the_pod_literally():
    hostile = "/x y/$(HOME)/'q'/\"d\"/$$/`id`;rm -rf ~"
    values = values_for(
        f"runtime.python={hostile}",
        f"network.interface={hostile}",
        f"runtime.image={hostile}",
    )
    job, container, kinds = job_parts(render_chart(values))
    env = pod_env(container)
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == hostile
    assert expand(container["args"][0], env) == hostile
    assert container["image"] == hostile
    assert yaml.safe_load(kinds["ConfigMap"]["data"]["run.yaml"])["launch"]["python"] == hostile


def test_secondary_rdma_networks_become_the_multus_annotation():
    values = values_for(
        "kubernetes.networks=[ib-sriov-a, ib-sriov-b]", gpu="h100-80gb", fabric="infiniband", per_node=8
    )
    job, container, _ = job_parts(render_chart(values))
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations["k8s.v1.cni.cncf.io/networks"] == "ib-sriov-a,ib-sriov-b"


def test_secrets_are_referenced_never_inlined(tmp_path):
    values = values_for("kubernetes.secret_env={HF_TOKEN: hf-credentials/token}")
    job, container, kinds = job_parts(render_chart(values))
    (ref,) = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
    assert ref == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-credentials", "key": "token"}},
    }
    r = cli("render", "helm", "--set", "kubernetes.secret_env={HF_TOKEN: s3cr3t}", "-o", str(tmp_path / "o"))
    assert r.returncode == EXIT_BAD_INPUT and "kubernetes.secret_env" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_render_helm_writes_values_and_the_chart_it_was_made_for(tmp_path):
    out = tmp_path / "run-helm"
    r = cli(
        "render", "helm", "--nodes", "2", "--set", f"storage.root={tmp_path}/s", "-o", str(out), check=True
    )
    assert f"helm install dskit-run {out / 'chart'} -f {out / 'values.yaml'}" in r.stdout
    assert (out / "chart" / "templates" / "job.yaml").read_text() == (
        CHART / "templates" / "job.yaml"
    ).read_text()
    values = yaml.safe_load((out / "values.yaml").read_text())
    assert values["plan"] == (out / "run.yaml").read_text()
    assert lint_problems(values, out / "chart") == []


def test_render_helm_refuses_paths_the_pods_would_not_mount(tmp_path):
    out = tmp_path / "o"
    r = cli(
        "render",
        "helm",
        "--set",
        f"storage.root={tmp_path}/s",
        "--set",
        f"storage.checkpoint_dir={tmp_path}/elsewhere",
        "-o",
        str(out),
    )
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    assert r.stderr.startswith("dskit: error: storage.checkpoint_dir:") and "outside storage.root" in r.stderr
    assert not out.exists()


def test_launcher_scripts_pass_shellcheck():
    scripts = sorted((CHART / "files").glob("*.sh"))
    r = subprocess.run([SHELLCHECK, *map(str, scripts)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_pod_failure_policy_maps_the_trainers_exit_codes():
    job, _, _ = job_parts(render_chart(values_for()))
    assert failure_action(job, EXIT_REQUEUE) == "Ignore"
    assert failure_action(job, EXIT_BAD_INPUT) == "FailJob"
    assert failure_action(job, EXIT_DISK_FULL) == "FailJob"  # a retry fills the same disk
    assert failure_action(job, 1) == "Count"
    assert job["spec"]["backoffLimit"] == 2 * 3  # max_restarts x nodes
    rule = job["spec"]["podFailurePolicy"]["rules"][-1]
    assert rule == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


# --------------------------------------------------------------------------- the pods, run


@pytest.fixture
def pods_for(tmp_path, pod_hosts):
    """Pods of a 2-node CPU render (1 rank per pod, EP=2, gloo over the hosts' eth0), not yet started."""
    made: list[Pods] = []

    def make(
        steps: int, every: int, *, tamper=None, dns_timeout: int = 120, command: str = "render"
    ) -> tuple[Pods, Path]:
        run_dir = render_tiny(
            tmp_path, name=RELEASE, target="helm", steps=steps, nodes=2, gpus_per_node=1,
            extra=[f"checkpoint.every={every}", "network.interface=eth0",
                   f"kubernetes.peer_dns_timeout={dns_timeout}"], command=command,
        )  # fmt: skip
        values = yaml.safe_load((run_dir / helm_render.VALUES).read_text())
        if tamper:
            tamper(values)
        job, _, kinds = job_parts(render_chart(values, run_dir / helm_render.CHART))
        claim = job["spec"]["template"]["spec"]["volumes"]
        claim = next(v for v in claim if "persistentVolumeClaim" in v)["persistentVolumeClaim"]["claimName"]
        pods = Pods(tmp_path / "pods", job, {kinds["ConfigMap"]["metadata"]["name"]: kinds["ConfigMap"]},
                    {claim: str(tmp_path / "storage")})  # fmt: skip
        pods.base.mkdir()
        made.append(pods)
        pods.up()
        return pods, run_dir

    yield make
    for p in made:
        p.down()


def steps_logged(pods: Pods) -> list[int]:
    text = "".join(pods.log(i) for i in range(pods.nodes))
    return [int(s) for s in re.findall(r"step (\d+)/\d+ loss", text)]


@pytest.mark.train
def test_pods_train_across_two_hosts_checkpoint_and_resume_after_preemption(pods_for):
    pods, run_dir = pods_for(steps=40, every=4)
    plan = load_plan(run_dir / "run.yaml")

    # Gang start: pod 0 waits in its init step until pod 1's DNS name resolves.
    pods.publish([0])
    pod0 = pods.run_pod(0)
    time.sleep(5)
    assert pod0.phase == "Init", pods.logs()
    pods.publish([0, 1])
    pod1 = pods.run_pod(1)
    wait_for(lambda: pod0.phase == pod1.phase == "Running", 30, "both pods running", pods)

    # Preemption of pod 1: SIGTERM to its entrypoint. Both pods checkpoint and exit 75, which the Job's
    # podFailurePolicy ignores: it restarts both, and they resume from the checkpoint.
    wait_for(lambda: max(steps_logged(pods), default=0) >= 6, 240, "step 6", pods)
    pod1.terminate()
    codes = {0: pod0.wait(120), 1: pod1.wait(120)}
    assert codes == {0: EXIT_REQUEUE, 1: EXIT_REQUEUE}, pods.logs()
    assert {failure_action(pods.job, c) for c in codes.values()} == {"Ignore"}
    stopped_at = max(steps_logged(pods))
    assert "TERM received" in pods.log(1) and "ranks checkpointed and stopped" in pods.log(0)
    assert not Path(plan.run.output_dir, COMPLETE_FILE).exists()

    second = [pods.run_pod(i, attempt=1) for i in (0, 1)]
    assert [p.wait(300) for p in second] == [0, 0], pods.logs()
    assert Path(plan.run.output_dir, COMPLETE_FILE).exists()
    steps = steps_logged(pods)
    assert sorted(set(steps)) == list(range(1, 41)), "every step logged, none lost"
    assert re.search(rf"resum\w* .*step {stopped_at}\b", pods.log(0)), pods.log(0)[-3000:]
    # rank 0 and rank 1 ran on the two pods (hostnames NAME-0, NAME-1)
    assert f"rank 0 of 2 on {RELEASE}-0" in pods.log(0) and f"rank 1 of 2 on {RELEASE}-1" in pods.log(1)
    # the trainer saw the launch contract the chart rendered, run.yaml at the ConfigMap's mount
    seen = json.loads(Path(plan.run.output_dir, LAUNCH_ENV_FILE).read_text())
    assert seen["DSKIT_RUN_FILE"] == helm_render.run_file_path()
    assert {k: seen[k] for k in plan.env} == plan.env
    assert seen["DSKIT_SHM_BYTES"] == str(plan.launch.shm_bytes)


@pytest.mark.train
def test_pods_run_the_calibration_job_across_two_hosts(pods_for):
    """`dskit calibrate helm`: the same chart and pods, run.yaml's calibrate section; rank 0 writes the
    calibration of the group across the two hosts to the shared volume."""
    pods, run_dir = pods_for(steps=1, every=1, command="calibrate")
    plan = load_plan(run_dir / "run.yaml")
    pods.publish([0, 1])
    started = [pods.run_pod(i) for i in (0, 1)]
    assert [p.wait(300) for p in started] == [0, 0], pods.logs()
    cal = calibration.load(
        plan.calibrate.file, field="f", gpu="cpu", fabric=plan.launch.fabric, procs_per_node=1
    )
    assert cal.hardware.nodes == 2 and all("1x2" in cal.collectives[op] for op in cal.collectives)
    assert "dskit: calibrate: wrote" in pods.log(0)


@pytest.mark.train
def test_a_lost_node_costs_a_restart_not_the_run(pods_for):
    """Pod 1's node dies mid-run (SIGKILL of all its processes, no grace). The Job replaces the pod
    without counting it (DisruptionTarget); pod 0's ranks lose their peer, and torchrun either restarts
    them when the new pod joins the rendezvous or they fail and are replaced, counted. Either way the
    run resumes from its last checkpoint and completes within backoffLimit."""
    pods, run_dir = pods_for(steps=40, every=4)
    plan = load_plan(run_dir / "run.yaml")
    pods.publish([0, 1])
    ctl = JobController(pods)
    done = threading.Thread(target=ctl.run, args=(600,), daemon=True)
    done.start()
    wait_for(lambda: max(steps_logged(pods), default=0) >= 6, 240, "step 6", pods)
    ctl.lose_node(1)
    done.join(600)
    assert ctl.result == "Complete", (ctl.history, pods.logs())
    assert (1, 0, -9, "Ignore") in ctl.history
    assert ctl.failures <= pods.job["spec"]["backoffLimit"]
    assert sorted(set(steps_logged(pods))) == list(range(1, 41)), "every step logged, none lost"
    assert Path(plan.run.output_dir, COMPLETE_FILE).exists()
    assert "resumed from" in pods.log(0)


@pytest.mark.train
def test_a_configuration_error_fails_the_job_instead_of_retrying(pods_for):
    def wrong_profile(values):
        values["trainer"]["env"]["DSKIT_GPU_PROFILE"] = "h100-80gb"  # run.yaml says cpu

    pods, _ = pods_for(steps=4, every=2, tamper=wrong_profile)
    pods.publish([0, 1])
    runs = [pods.run_pod(i) for i in (0, 1)]
    codes = [p.wait(120) for p in runs]
    assert codes == [EXIT_BAD_INPUT, EXIT_BAD_INPUT], pods.logs()
    assert failure_action(pods.job, EXIT_BAD_INPUT) == "FailJob"
    assert "DSKIT_GPU_PROFILE" in pods.log(0)


@pytest.mark.slow  # waits out the peer DNS timeout (~10 s)
def test_a_pod_whose_peers_never_appear_fails_its_init_step_with_the_reason(pods_for):
    pods, _ = pods_for(steps=4, every=2, dns_timeout=10)
    pods.publish([0])  # pod 1 is never scheduled
    pod0 = pods.run_pod(0)
    assert pod0.wait(60) == 1 and pod0.main is None, "the trainer must not start"
    assert f"{RELEASE}-1.{RELEASE} did not resolve within 10s" in pods.log(0)


# --------------------------------------------------------------------------- dskit status


def test_status_without_a_cluster_config_is_one_clear_line(tmp_path):
    r = cli("status", "demo", env={"KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)})
    assert r.returncode == EXIT_BAD_INPUT
    assert r.stderr.strip().splitlines() == [
        "dskit: error: --kubeconfig: no Kubernetes configuration: set KUBECONFIG, pass --kubeconfig, or run in a pod"
    ]


def test_status_table_lists_ranks_attempts_and_how_pods_ended():
    """Pods as the Job controller makes them from the rendered template (index annotation, labels),
    with the statuses a preempted and restarted run reports, read through the client's own models."""
    from kubernetes.client import ApiClient

    from dskit.status.k8s import format_table, pod_rows

    job, container, _ = job_parts(render_chart(values_for()))
    template = job["spec"]["template"]

    def pod(index: int, attempt: int, phase: str, state: dict) -> object:
        meta = {
            **template["metadata"],
            "name": f"{RELEASE}-{index}-{attempt}abcd",
            "creationTimestamp": f"2026-11-30T10:0{attempt}:00Z",
            "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
        }
        status = {"phase": phase, "containerStatuses": [{"name": "trainer", "state": state, "ready": False,
                                                         "restartCount": 0, "image": "i", "imageID": ""}]}  # fmt: skip
        raw = {"metadata": meta, "spec": {**template["spec"], "nodeName": f"gpu-{index}"}, "status": status}
        # the client's own decoder for API responses (its public wrapper's signature varies by version)
        return ApiClient()._ApiClient__deserialize(json.loads(json.dumps(raw)), "V1Pod")

    stopped = {"terminated": {"exitCode": EXIT_REQUEUE, "reason": "Error"}}
    pods = [
        pod(1, 2, "Running", {"running": {}}),
        pod(0, 1, "Failed", stopped),
        pod(1, 1, "Failed", stopped),
        pod(0, 2, "Running", {"running": {}}),
    ]
    lines = format_table(pod_rows(pods)).splitlines()
    assert lines[0].split() == ["RANK-INDEX", "ATTEMPTS", "POD", "PHASE", "NODE", "DETAIL"]
    assert [line.split()[:4] for line in lines[1:]] == [
        ["0", "2", f"{RELEASE}-0-1abcd", "Failed"],
        ["0", "2", f"{RELEASE}-0-2abcd", "Running"],
        ["1", "2", f"{RELEASE}-1-1abcd", "Failed"],
        ["1", "2", f"{RELEASE}-1-2abcd", "Running"],
    ]
    assert lines[1].endswith(f"trainer exited {EXIT_REQUEUE} (Error)") and lines[2].endswith(
        "trainer running"
    )
