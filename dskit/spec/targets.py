"""The run spec's sections for one target each: slurm, ray and kubernetes (the Helm chart, and the
Ray target's rayjob.yaml). dskit/spec/run_spec.py's Spec holds them; the plan copies them (dskit/plan/schema.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from dskit.spec.values import (
    ENV_NAME_RE,
    K8S_LABEL_KEY_RE,
    K8S_LABEL_VALUE_RE,
    K8S_NAME_RE,
    K8S_QUANTITY_RE,
    MAX_SLURM_DAYS,
    SBATCH_ARG_RE,
    SECRET_KEY_RE,
    SLURM_TIME_RE,
    SLURM_WORD_RE,
    _Section,
)


def split_secret_ref(ref: str) -> tuple[str, str]:
    """'secret-name/key' -> (secret name, key); kubernetes.secret_env validates the parts."""
    secret, _, key = ref.partition("/")
    return secret, key


class SlurmSpec(_Section):
    partition: str | None = Field(None, description="Slurm partition.")
    account: str | None = Field(None, description="Slurm account.")
    qos: str | None = Field(None, description="Slurm QOS.")
    time: str = Field("24:00:00", description="Time limit, [D-]HH:MM[:SS].")
    grace_seconds: int = Field(
        180,
        ge=10,
        le=65535,  # sbatch --signal=USR1@N
        description="Seconds before the time limit at which Slurm sends USR1 (checkpoint + requeue).",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Extra #SBATCH flags, each '--flag' or '--flag=value'."
    )
    chain: int = Field(
        1,
        ge=1,
        le=1000,
        description="Links in a chain of jobs (submit.sh, --dependency=afterany) for runs longer than the "
        "time limit. 1: a single job that requeues itself at the time limit instead.",
    )

    @field_validator("partition", "account", "qos")
    @classmethod
    def _word(cls, v: str | None) -> str | None:
        if v is not None and not SLURM_WORD_RE.match(v):
            raise ValueError("must contain only letters, digits and _ . , -")
        return v

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        m = SLURM_TIME_RE.match(v)
        if not m:
            raise ValueError("must look like HH:MM:SS or D-HH:MM:SS")
        days, rest = (int(m.group(1)[:-1]), v.split("-", 1)[1]) if m.group(1) else (0, v)
        hours, minutes, *sec = (int(x) for x in rest.split(":"))
        seconds = sec[0] if sec else 0
        if minutes >= 60 or seconds >= 60:
            raise ValueError(f"{v!r}: minutes and seconds must be below 60 (HH:MM:SS or D-HH:MM:SS)")
        total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
        if not 0 < total <= MAX_SLURM_DAYS * 86400:
            raise ValueError(f"{v!r}: must be more than 0 and at most {MAX_SLURM_DAYS} days")
        return v

    @field_validator("extra_args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        for a in v:
            if not SBATCH_ARG_RE.match(a):
                raise ValueError(f"{a!r} is not a plain '--flag' or '--flag=value' (no spaces, quotes or $)")
        return v


class RaySpec(_Section):
    max_failures: int = Field(
        2,
        ge=0,
        le=1000,
        description="Worker-group restarts Ray Train allows (a lost worker restarts the group, which resumes).",
    )
    storage_path: str | None = Field(None, description="Ray Train storage_path. Default: ROOT/NAME/ray.")


class Toleration(_Section):
    key: str | None = Field(None, description="Taint key (omit with operator Exists to tolerate all taints).")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal or Exists.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect; omit to match all effects."
    )

    @field_validator("key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and not K8S_LABEL_KEY_RE.match(v):
            raise ValueError(f"{v!r} is not a Kubernetes label key")
        return v

    @field_validator("value")
    @classmethod
    def _value(cls, v: str | None) -> str | None:
        if v is not None and not K8S_LABEL_VALUE_RE.match(v):
            raise ValueError(f"{v!r} is not a Kubernetes label value")
        return v


#: KubernetesSpec's fields left out of run.yaml at their defaults (see _quiet_defaults)
QUEUEING_FIELDS = ("workload", "queue", "queue_priority", "topology", "topology_level")


class KubernetesSpec(_Section):
    existing_claim: str | None = Field(
        None,
        description="ReadWriteMany PersistentVolumeClaim mounted at storage.root for checkpoints. Default: "
        "the chart creates RELEASE-storage (kept on `helm uninstall`); the Ray target's rayjob.yaml creates "
        "NAME-storage.",
    )
    storage_size: str = Field("1Ti", description="Size of the claim the chart (or rayjob.yaml) creates.")
    storage_class: str | None = Field(None, description="StorageClass of the created claim (ReadWriteMany).")
    cpu: str | None = Field(None, description="CPU request per pod, e.g. '96'. Default: none.")
    memory: str | None = Field(
        None, description="Memory request per pod, e.g. '1600Gi' (the /dev/shm tmpfs counts against it)."
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector labels.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Pod tolerations.")
    priority_class: str | None = Field(None, description="PriorityClass name (preemption order).")
    service_account: str | None = Field(None, description="ServiceAccount the pods run as.")
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Names of existing docker-registry Secrets."
    )
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description="Env vars read from existing Secrets, NAME: 'secret-name/key' (values are never "
        "written into the rendered files).",
    )
    rdma_per_node: int = Field(
        1,
        ge=1,
        le=1024,
        description="RDMA device-plugin resources per pod (RDMA fabrics; e.g. 32 EFA on p5).",
    )
    networks: list[str] = Field(
        default_factory=list,
        description="Secondary networks for the pods (Multus NetworkAttachmentDefinition names, e.g. the "
        "SR-IOV InfiniBand/RoCE networks of the NVIDIA Network Operator); sets k8s.v1.cni.cncf.io/networks.",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        le=1000,  # backoffLimit = this x nodes (<= 10000) stays a Kubernetes int32
        description="Failed attempts of the whole pod group before the Job fails (backoffLimit = this x "
        "nodes). Preemptions and checkpoint-and-stop exits do not count.",
    )
    grace_seconds: int = Field(
        300,
        ge=10,
        le=2**31 - 1,
        description="terminationGracePeriodSeconds: time to checkpoint after SIGTERM.",
    )
    peer_dns_timeout: int = Field(
        900,
        ge=10,
        le=2**31 - 1,
        description="Seconds the init step waits for every pod's DNS name (gang start).",
    )
    workload: Literal["job", "jobset", "trainjob"] = Field(
        "job",
        description="The object the chart submits: job (an Indexed Job), jobset (a JobSet, jobset.x-k8s.io, "
        "restarting the whole group per failure.maxRestarts) or trainjob (a Kubeflow Trainer v2 TrainJob on "
        "the torch-distributed runtime; docs/targets.md says what its runtime cannot carry).",
    )
    queue: str | None = Field(
        None,
        description="Kueue LocalQueue: labels the workload kueue.x-k8s.io/queue-name and creates it "
        "suspended, for Kueue to admit. Default: no Kueue.",
    )
    queue_priority: str | None = Field(
        None,
        description="Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class); needs queue.",
    )
    topology: Literal["preferred", "required"] | None = Field(
        None,
        description="Kueue topology-aware scheduling: place all pods within one domain of topology_level "
        "(required), or as few as fit (preferred); needs queue.",
    )
    topology_level: str | None = Field(
        None,
        description="The node label naming the topology level (a level of the cluster's Kueue Topology). "
        "Default: the fabric's k8s_topology_level in the catalog.",
    )

    @model_serializer(mode="wrap")
    def _quiet_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # run.yaml records the queueing fields only when set: a spec without them renders byte for byte
        # what it rendered before they existed (and so does its Job, whose checksum covers run.yaml)
        data = handler(self)
        for name in QUEUEING_FIELDS:
            if name in data and data[name] == type(self).model_fields[name].default:
                del data[name]
        return data

    @model_validator(mode="after")
    def _queue_first(self) -> KubernetesSpec:
        for name in ("queue_priority", "topology"):
            if getattr(self, name) is not None and self.queue is None:
                raise ValueError(f"kubernetes.{name} is for Kueue: set kubernetes.queue (the LocalQueue) too")
        if self.topology_level is not None and self.topology is None:
            raise ValueError("kubernetes.topology_level needs kubernetes.topology: preferred or required")
        if self.workload == "trainjob":  # what the runtime's contract cannot carry: refused, not dropped
            if self.priority_class is not None:
                raise ValueError(
                    "kubernetes.priority_class: a TrainJob's runtime sets its pods' priority; use "
                    "kubernetes.queue_priority (Kueue) or kubernetes.workload jobset"
                )
            if self.max_restarts != type(self).model_fields["max_restarts"].default:
                raise ValueError(
                    "kubernetes.max_restarts: a TrainJob restarts as its runtime's failure policy says "
                    "(docs/targets.md); use kubernetes.workload jobset or job to set it"
                )
        return self

    @field_validator("queue", "queue_priority")
    @classmethod
    def _kueue_name(cls, v: str | None) -> str | None:
        if v is not None and not K8S_NAME_RE.match(v):
            raise ValueError(
                f"{v!r} is not a Kueue object name: lowercase letters, digits and '-', 1-63 characters"
            )
        return v

    @field_validator("topology_level")
    @classmethod
    def _node_label(cls, v: str | None) -> str | None:
        if v is not None and not K8S_LABEL_KEY_RE.match(v):
            raise ValueError(f"{v!r} is not a node label key such as network.topology.nvidia.com/leaf")
        return v

    @field_validator("existing_claim", "storage_class", "priority_class", "service_account")
    @classmethod
    def _k8s_name(cls, v: str | None) -> str | None:
        if v is not None and not K8S_NAME_RE.match(v):
            raise ValueError("must be a Kubernetes name: lowercase letters, digits and '-', 1-63 characters")
        return v

    @field_validator("storage_size", "cpu", "memory")
    @classmethod
    def _quantity(cls, v: str | None) -> str | None:
        if v is not None and not K8S_QUANTITY_RE.match(v):
            raise ValueError("must be a Kubernetes quantity such as 8, 500m, 64Gi or 1Ti")
        return v

    @field_validator("image_pull_secrets", "networks")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not K8S_NAME_RE.match(name):
                raise ValueError(f"{name!r} is not a Kubernetes name")
        return v

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not K8S_LABEL_KEY_RE.match(key) or not K8S_LABEL_VALUE_RE.match(value):
                raise ValueError(f"{key}={value!r} is not a valid Kubernetes label")
        return v

    @field_validator("secret_env")
    @classmethod
    def _secret_refs(cls, v: dict[str, str]) -> dict[str, str]:
        for env, ref in v.items():
            secret, key = split_secret_ref(ref)
            if not ENV_NAME_RE.match(env):
                raise ValueError(f"{env!r} is not an environment variable name")
            if not K8S_NAME_RE.match(secret) or not SECRET_KEY_RE.match(key):
                raise ValueError(f"{env}: {ref!r} is not 'secret-name/key'")
        return v
