"""The Helm chart's values, as a model: `dskit render helm` builds them through it, and the chart's
values.schema.json is generated from it (`make examples`), so what dskit writes and what `helm install`
accepts cannot drift apart. Enum fields the Kubernetes OpenAPI schemas leave open (pull policy, access
modes, toleration operators and effects) are closed here.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic.alias_generators import to_camel

from dskit.spec.values import ENV_NAME_RE, K8S_LABEL_KEY_RE, K8S_NAME_RE, K8S_QUANTITY_RE, SECRET_KEY_RE


def portable(pattern: re.Pattern) -> str:
    """A spec_values.py pattern for pydantic's Rust engine and JSON Schema: both read `$` as the very end
    (Python's re also matches it before a trailing newline, hence spec_values.py's \\Z)."""
    return pattern.pattern.removesuffix(r"\Z") + "$"


def _optional(pattern: re.Pattern) -> str:
    """The same pattern, or the empty string (the chart's 'not set')."""
    return f"^({portable(pattern).removeprefix('^').removesuffix('$')})?$"


K8sName = Annotated[str, StringConstraints(pattern=portable(K8S_NAME_RE))]
OptionalK8sName = Annotated[str, StringConstraints(pattern=_optional(K8S_NAME_RE))]
EnvName = Annotated[str, StringConstraints(pattern=portable(ENV_NAME_RE))]
Quantity = Annotated[str, StringConstraints(pattern=portable(K8S_QUANTITY_RE))]
AbsPath = Annotated[str, StringConstraints(pattern=r"^/")]
ExitCode = Annotated[int, Field(ge=1, le=255)]


class _Values(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


class Image(_Values):
    ref: str = Field(min_length=1, description="Image reference (build it with `dskit render image`).")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    pull_secrets: list[K8sName] = Field(default_factory=list, description="Existing docker-registry Secrets.")


class SecretEnv(_Values):
    name: EnvName
    secret_name: K8sName
    key: Annotated[str, StringConstraints(pattern=portable(SECRET_KEY_RE))]


class Trainer(_Values):
    args: list[str] = Field(description="The node's torchrun command, in Kubernetes syntax ($(VAR) expands).")
    env: dict[EnvName, str] = Field(description="The launch contract, literal values.")
    secret_env: list[SecretEnv] = Field(default_factory=list, description="Env from Secrets, by reference.")


class Contract(_Values):
    stop_file: AbsPath
    complete_file: AbsPath
    exit_requeue: ExitCode
    exit_bad_input: ExitCode
    exit_disk_full: ExitCode


class Shm(_Values):
    size_limit: Quantity


class Storage(_Values):
    mount_path: AbsPath
    existing_claim: OptionalK8sName = ""
    size: Quantity = "1Ti"
    storage_class_name: OptionalK8sName = ""
    access_modes: list[Literal["ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany", "ReadWriteOncePod"]] = Field(
        default_factory=lambda: ["ReadWriteMany"], min_length=1
    )


class Rdma(_Values):
    enabled: bool = False
    resource: Annotated[str, StringConstraints(pattern=r"^([a-z0-9.-]+/[a-z0-9._-]+)?$")] = ""
    per_node: int = Field(1, ge=1)


class Resources(_Values):
    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity | int] = Field(default_factory=dict)


class Toleration(_Values):
    key: str | None = None
    operator: Literal["Equal", "Exists"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Failure(_Values):
    max_restarts: int = Field(3, ge=0)
    active_deadline_seconds: int | None = Field(None, ge=1)


class Kueue(_Values):
    """Submission through Kueue: the workload is labelled for its LocalQueue and created suspended."""

    queue_name: OptionalK8sName = Field("", description="LocalQueue (label kueue.x-k8s.io/queue-name).")
    priority_class: OptionalK8sName = Field(
        "", description="WorkloadPriorityClass (label kueue.x-k8s.io/priority-class)."
    )
    topology: Literal["", "preferred", "required"] = Field(
        "", description="Topology-aware scheduling of the pods (the podset-*-topology annotation)."
    )
    topology_level: Annotated[str, StringConstraints(pattern=_optional(K8S_LABEL_KEY_RE))] = Field(
        "", description="Node label of the topology level (a level of the cluster's Kueue Topology)."
    )

    @model_validator(mode="after")
    def _needs_queue(self) -> Kueue:
        # the chart fails on the same combinations (helm/dskit/templates/_helpers.tpl: dskit.workloadLabels,
        # dskit.kueueTopology)
        if (self.priority_class or self.topology) and not self.queue_name:
            raise ValueError("priorityClass and topology need queueName")
        if bool(self.topology) != bool(self.topology_level):
            raise ValueError("topology and topologyLevel go together")
        return self


class TrainJob(_Values):
    runtime: K8sName = Field(
        "torch-distributed", description="The ClusterTrainingRuntime the TrainJob runs on (torch plugin)."
    )


class PodSecurityContext(_Values):
    """The pod's securityContext (subset): make the pods non-root where the image allows it."""

    run_as_non_root: bool | None = None
    run_as_user: int | None = Field(None, ge=0)
    run_as_group: int | None = Field(None, ge=0)
    fs_group: int | None = Field(None, ge=0)


class ChartValues(_Values):
    plan: str
    nodes: int = Field(ge=1)
    procs_per_node: int = Field(ge=1)
    gpus_per_node: int = Field(ge=0)
    fullname_override: Annotated[
        str, StringConstraints(pattern=r"^([a-z0-9]([a-z0-9-]{0,50}[a-z0-9])?)?$")
    ] = ""
    image: Image
    trainer: Trainer
    contract: Contract
    rendezvous_port: int = Field(29500, ge=1, le=65535)
    peer_dns_timeout_seconds: int = Field(900, ge=1)
    shm: Shm
    storage: Storage
    rdma: Rdma = Field(default_factory=Rdma)
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    spread_over_nodes: bool = True
    priority_class_name: OptionalK8sName = ""
    service_account_name: OptionalK8sName = ""
    pod_security_context: PodSecurityContext = Field(default_factory=PodSecurityContext)
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    pod_labels: dict[str, str] = Field(default_factory=dict)
    failure: Failure = Field(default_factory=Failure)
    termination_grace_period_seconds: int = Field(300, ge=0)
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    workload: Literal["job", "jobset", "trainjob"] = "job"
    kueue: Kueue = Field(default_factory=Kueue)
    train_job: TrainJob = Field(default_factory=TrainJob)


def _close_pattern_maps(node: Any) -> None:
    # pydantic states key patterns as patternProperties, which alone still admit other keys
    if isinstance(node, dict):
        if "patternProperties" in node:
            node.setdefault("additionalProperties", False)
        for v in node.values():
            _close_pattern_maps(v)
    elif isinstance(node, list):
        for v in node:
            _close_pattern_maps(v)


def values_schema() -> dict:
    schema = ChartValues.model_json_schema(by_alias=True)
    _close_pattern_maps(schema)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "dskit chart values (generated from dskit/render/helm_values.py)"
    return schema


def values_schema_json() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"
