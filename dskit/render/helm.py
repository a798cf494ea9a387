"""Kubernetes target: plan -> values.yaml for the chart in helm/dskit, plus a copy of that chart.

The chart owns the Kubernetes objects (Indexed Job, headless Service, ConfigMap, claim); this module
only maps the plan into its values (validated by `ChartValues`, whose schema the chart ships). The run
directory carries its own copy of the chart so the values and the templates that read them travel
together: `helm install NAME RUN_DIR/chart -f RUN_DIR/values.yaml`.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from dskit import __version__, catalog
from dskit.errors import EXIT_BAD_INPUT, SpecError
from dskit.launch.contract import (
    COMPLETE_FILE,
    EXIT_DISK_FULL,
    EXIT_REQUEUE,
    K8S_CONFIG_MOUNT,
    RESERVED_ENV,
    RESERVED_ENV_PREFIX,
    RUN_YAML,
    STOP_FILE,
)
from dskit.plan.schema import Plan, dump_plan
from dskit.render.common import (
    comment_block,
    dump_yaml,
    k8s_literal,
    package_data_dir,
    render_template,
    run_files,
    torchrun_words,
)
from dskit.render.helm_values import ChartValues, Kueue, TrainJob
from dskit.spec.targets import KubernetesSpec, split_secret_ref

VALUES, CHART = "values.yaml", "chart"
#: Pod annotation Multus reads to attach secondary (RDMA) networks.
MULTUS_NETWORKS = "k8s.v1.cni.cncf.io/networks"
#: The JobSet's one replicated job (the TrainJob's torch runtime names its own the same): its pods are
#: NAME-node-0-INDEX, as helm/dskit/templates/_helpers.tpl's dskit.podPrefix spells them.
REPLICATED_JOB = "node"
#: A DNS label: JobSet and TrainJob names must be one (RFC 1035), as must their pods' names
DNS_LABEL_MAX = 63


def chart_dir() -> Path:
    return package_data_dir("chart", "helm/dskit")


def _under_root(plan: Plan) -> None:
    """Pods mount only the storage root: every path the trainer writes or reads must lie under it."""
    root = plan.launch.storage_root.rstrip("/") + "/"
    for field, path in (
        ("storage.checkpoint_dir", plan.run.checkpoint_dir),
        ("storage.output_dir", plan.run.output_dir),
        ("data.path", plan.run.data_path),
        ("data.eval_path", plan.run.eval_path),
        *((f"data.sources[{i}].path", path) for i, (path, _) in enumerate(plan.run.data_sources or [])),
    ):
        if path is not None and not (path + "/").startswith(root):
            raise SpecError(
                field,
                f"{path} is outside storage.root ({plan.launch.storage_root}), the only path the pods mount; "
                "move it under the root",
            )


def _group_name(plan: Plan) -> None:
    """A JobSet's (or TrainJob's) pods are named NAME-node-0-INDEX-xxxxx, which JobSet's webhook
    requires to be an RFC 1035 label: the run's name (the proposed release name) must leave room."""
    if plan.kubernetes.workload == "job":
        return
    longest = f"{plan.name}-{REPLICATED_JOB}-0-{plan.hardware.nodes - 1}-xxxxx"
    room = DNS_LABEL_MAX - (len(longest) - len(plan.name))
    if len(longest) <= DNS_LABEL_MAX and plan.name[0].isalpha():
        return
    which, give = repr(plan.name), f"a name of at most {room} characters starting with a letter"
    if plan.calibrate is not None:
        # the calibration job is named after the run: the name to change, and its limit, are the run's
        from dskit.calibrate.measures import calibration_suffix

        suffix = calibration_suffix(plan.name)
        which = f"the calibration job's name {plan.name!r} (the run's name and {suffix!r})"
        give = f"give the run a name of at most {room - len(suffix)} characters starting with a letter"
    raise SpecError(
        "name",
        f"{which} cannot name a {plan.kubernetes.workload}: its pods are {longest!r}, which must start "
        f"with a letter and fit {DNS_LABEL_MAX} characters: {give}",
    )


def _kueue(plan: Plan) -> Kueue:
    """The Kueue values; the topology level is the spec's, else the fabric's (catalog) default."""
    k = plan.kubernetes
    level = ""
    if k.topology is not None:
        level = k.topology_level or catalog.fabric(plan.launch.fabric).k8s_topology_level or ""
        if not level:
            raise SpecError(
                "kubernetes.topology_level",
                f"the {plan.launch.fabric} fabric names no topology level in the catalog: set it to a node "
                "label of the cluster's Kueue Topology, e.g. kubernetes.topology_level=cloud.provider.com/"
                "topology-rack",
            )
    return Kueue(
        queue_name=k.queue or "",
        priority_class=k.queue_priority or "",
        topology=k.topology or "",
        topology_level=level,
    )


def values(plan: Plan) -> ChartValues:
    _under_root(plan)
    _group_name(plan)
    k = plan.kubernetes
    requests = {name: v for name in ("cpu", "memory") if (v := getattr(k, name))}
    secret_env = []
    reserved = RESERVED_ENV | set(plan.env)
    for name, ref in k.secret_env.items():
        if name in reserved or name.startswith(RESERVED_ENV_PREFIX):
            raise SpecError(
                "kubernetes.secret_env",
                f"{name} is set by dskit's launch contract or the plan's env; names other than "
                f"{RESERVED_ENV_PREFIX}*, {', '.join(sorted(reserved))} are allowed",
            )
        secret, key = split_secret_ref(ref)
        secret_env.append({"name": name, "secretName": secret, "key": key})
    try:
        return _chart_values(plan, k, requests, secret_env)
    except ValidationError as e:  # what the spec admits but the chart does not: one line, not a traceback
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "values"
        raise SpecError(f"chart values {where}", err["msg"]) from None


def _chart_values(plan: Plan, k: KubernetesSpec, requests: dict, secret_env: list) -> ChartValues:
    hw, la = plan.hardware, plan.launch
    return ChartValues.model_validate(
        {
            "plan": dump_plan(plan),
            "nodes": hw.nodes,
            "procsPerNode": hw.procs_per_node,
            "gpusPerNode": hw.procs_per_node if hw.on_gpu else 0,
            "image": {"ref": la.image, "pullSecrets": k.image_pull_secrets},
            "trainer": {
                "args": torchrun_words(
                    plan,
                    quote=k8s_literal,
                    endpoint="$(MASTER_ADDR):$(MASTER_PORT)",
                    rdzv_id="$(DSKIT_RDZV_ID)",
                ),
                "env": dict(plan.env),
                "secretEnv": secret_env,
            },
            "contract": {
                "stopFile": f"{plan.run.checkpoint_dir}/{STOP_FILE}",
                "completeFile": f"{plan.run.output_dir}/{COMPLETE_FILE}",
                "exitRequeue": EXIT_REQUEUE,
                "exitBadInput": EXIT_BAD_INPUT,
                "exitDiskFull": EXIT_DISK_FULL,
            },
            "rendezvousPort": la.rdzv_port,
            "peerDnsTimeoutSeconds": k.peer_dns_timeout,
            "shm": {"sizeLimit": str(la.shm_bytes)},
            "storage": {
                "mountPath": la.storage_root,
                "existingClaim": k.existing_claim or "",
                "size": k.storage_size,
                "storageClassName": k.storage_class or "",
            },
            "rdma": {
                "enabled": la.fabric_rdma and la.fabric_k8s_resource is not None,
                "resource": la.fabric_k8s_resource or "",
                "perNode": k.rdma_per_node,
            },
            "resources": {"requests": requests},
            "nodeSelector": k.node_selector,
            "podAnnotations": {MULTUS_NETWORKS: ",".join(k.networks)} if k.networks else {},
            "tolerations": [t.model_dump(mode="json", exclude_none=True) for t in k.tolerations],
            "priorityClassName": k.priority_class or "",
            "serviceAccountName": k.service_account or "",
            "failure": {"maxRestarts": k.max_restarts},
            "terminationGracePeriodSeconds": k.grace_seconds,
            "workload": k.workload,
            "kueue": _kueue(plan).model_dump(by_alias=True),
        }
    )


#: values.yaml leaves these out at their defaults: a spec without Kueue or a workload kind renders the
#: values it rendered before they existed
_QUIET = {"workload": "job", "kueue": Kueue(), "train_job": TrainJob()}


def values_yaml(plan: Plan) -> str:
    v = values(plan)
    quiet = {name for name, default in _QUIET.items() if getattr(v, name) == default}
    data = v.model_dump(mode="json", by_alias=True, exclude_none=True, exclude=quiet)
    header = comment_block(
        f"Rendered by dskit {__version__} for: {plan.summary()}",
        "Do not edit the plan here: change the spec and re-render. Site settings (affinity, annotations,",
        "limits) go in a second values file: helm install NAME CHART -f values.yaml -f site.yaml",
    )
    return header + dump_yaml(data)


LAUNCH_SCRIPT = "files/launch.sh"


def launch_script() -> str:
    """The pods' entrypoint, generated into the chart (make examples) from templates/helm/launch.sh.j2,
    which shares its stop/reap logic with Slurm's job.sbatch; a test checks the chart's copy is current."""
    return render_template("helm/launch.sh.j2")


def chart_files() -> dict[str, str]:
    root = chart_dir()
    return {
        f"{CHART}/{p.relative_to(root)}": p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def render(plan: Plan, out_dir: Path) -> dict[str, str]:
    """The run directory's files; nothing in them depends on where it lives (`out_dir`)."""
    return {**run_files(plan), VALUES: values_yaml(plan), **chart_files()}


def run_file_path() -> str:
    """DSKIT_RUN_FILE inside the pods: the chart mounts the ConfigMap at K8S_CONFIG_MOUNT
    (helm/dskit/templates/job.yaml; the contract test checks the two agree)."""
    return os.path.join(K8S_CONFIG_MOUNT, RUN_YAML)
