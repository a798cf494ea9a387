"""Ray target: plan -> runtime_env.yaml + submit.sh (`ray job submit`) and a KubeRay RayJob manifest.

The job directory is the job's working_dir: run.yaml travels with it, and DSKIT_RUN_FILE names it
relative to that dir (dskit.launch.ray_train makes it absolute for the workers).
"""

from __future__ import annotations

from pathlib import Path

from dskit import __version__
from dskit.errors import SpecError
from dskit.launch.contract import JOBS_FILE, RUN_YAML, Env
from dskit.launch.contract import K8S_CONFIG_MOUNT as CONFIG_MOUNT
from dskit.plan.schema import Plan, dump_plan
from dskit.render.common import (
    comment_block,
    dump_yaml,
    dump_yaml_all,
    k8s_literal,
    q,
    render_template,
    run_files,
    shell_words,
)

RUNTIME_ENV, SUBMIT, RAYJOB = "runtime_env.yaml", "submit.sh", "rayjob.yaml"
ENTRY_MODULE = "dskit.launch.ray_train"
RAY_VERSION = "2.60.0"


def runtime_env(plan: Plan) -> dict:
    _no_dollar(plan)
    return {"env_vars": {**plan.env, Env.RUN_FILE.value: RUN_YAML}}


def _no_dollar(plan: Plan) -> None:
    """Ray expands $VAR and ${VAR} in runtime_env env_vars (os.path.expandvars, no escape), so a
    contract value with '$' cannot reach the workers unchanged: refuse it rather than run altered.
    The interpreter too: KubeRay pastes the entrypoint into a submitter's `bash -c` (where Kubernetes
    expands $(VAR) first) in one mode and hands it to the dashboard's shell as is in another, and no
    one escaping of '$' is right for both."""
    for name, value in plan.env.items():
        if "$" in value:
            raise SpecError(
                f"environment {name}",
                f"{value!r} contains '$', which Ray's runtime_env expands and cannot escape; "
                "remove it from the spec (network.*, storage.*) for the ray target",
            )
    if "$" in plan.launch.python:
        raise SpecError(
            "runtime.python",
            f"{plan.launch.python!r} contains '$', which KubeRay's entrypoint cannot carry literally; "
            "use a path without '$' for the ray target",
        )


def entrypoint(plan: Plan) -> str:
    """The job's command line. Ray runs it through a shell: every word is quoted (shlex)."""
    return shell_words([plan.launch.python, "-m", ENTRY_MODULE])


def _pod(plan: Plan, name: str, gpus: int, cpu_request: str) -> dict:
    la = plan.launch
    resources = {"requests": {"cpu": cpu_request, "memory": "8Gi"}, "limits": {}}
    if gpus:
        resources["limits"]["nvidia.com/gpu"] = gpus
        resources["requests"]["nvidia.com/gpu"] = gpus
    env = [
        {"name": k, "value": k8s_literal(v)}
        for k, v in {**plan.env, Env.RUN_FILE.value: f"{CONFIG_MOUNT}/{RUN_YAML}"}.items()
    ]
    return {
        "spec": {
            "containers": [
                {
                    "name": name,
                    "image": la.image,
                    "env": env,
                    "resources": resources,
                    "volumeMounts": [
                        {"name": "run-config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                        # NCCL and Ray's object store use /dev/shm; the container default is 64 MB
                        {"name": "dshm", "mountPath": "/dev/shm"},
                        {"name": "storage", "mountPath": la.storage_root},
                    ],
                }
            ],
            "volumes": [
                {"name": "run-config", "configMap": {"name": f"{plan.name}-run"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(la.shm_bytes)}},
                {"name": "storage", "persistentVolumeClaim": {"claimName": claim_name(plan)}},
            ],
        }
    }


def claim_name(plan: Plan) -> str:
    """The claim the pods mount at the storage root: kubernetes.existing_claim, else the one
    rayjob.yaml creates (NAME-storage, the chart's naming)."""
    return plan.kubernetes.existing_claim or f"{plan.name}-storage"


def _claim(plan: Plan) -> dict | None:
    """The PersistentVolumeClaim rayjob.yaml creates when the spec names none, as the chart's
    helm/dskit/templates/pvc.yaml does: ReadWriteMany, kubernetes.storage_size and storage_class."""
    k = plan.kubernetes
    if k.existing_claim:
        return None
    spec: dict = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": k.storage_size}}}
    if k.storage_class:
        spec["storageClassName"] = k.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim_name(plan), "labels": {"app.kubernetes.io/managed-by": "dskit"}},
        "spec": spec,
    }


def rayjob(plan: Plan) -> str:
    hw = plan.hardware
    _no_dollar(plan)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{plan.name}-run"},
        "data": {RUN_YAML: dump_plan(plan)},
    }
    job = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": plan.name, "labels": {"app.kubernetes.io/managed-by": "dskit"}},
        "spec": {
            "entrypoint": entrypoint(plan),
            "runtimeEnvYAML": dump_yaml(
                {"env_vars": {**plan.env, Env.RUN_FILE.value: f"{CONFIG_MOUNT}/{RUN_YAML}"}}
            ),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 3600,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0"},
                    "template": _pod(plan, "ray-head", 0, "2"),
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "trainers",
                        "replicas": hw.nodes,
                        "minReplicas": hw.nodes,
                        "maxReplicas": hw.nodes,
                        "rayStartParams": {},
                        "template": _pod(
                            plan, "ray-worker", hw.procs_per_node if hw.on_gpu else 0, str(hw.procs_per_node)
                        ),
                    }
                ],
            },
        },
    }
    header = comment_block(
        f"Rendered by dskit {__version__}: KubeRay RayJob for {plan.summary()}.",
        "Needs the KubeRay operator. Checkpoints go to the claim "
        + (
            f"{claim_name(plan)} (kubernetes.existing_claim)."
            if plan.kubernetes.existing_claim
            else f"{claim_name(plan)}, created here and kept after the job (delete it when done)."
        ),
        "kubectl apply -f rayjob.yaml",
    )
    claim = _claim(plan)
    return header + dump_yaml_all([config_map, *([claim] if claim else []), job])


def render(plan: Plan, out_dir: Path) -> dict[str, str]:
    """The job directory's files; it is Ray's working_dir, so nothing in them names `out_dir`."""
    _no_dollar(plan)
    submit = render_template(
        "ray/submit.sh.j2",
        header=comment_block(f"Rendered by dskit {__version__}. Plan: {plan.summary()}"),
        python=q(plan.launch.python),
        module=ENTRY_MODULE,
        runtime_env=RUNTIME_ENV,
        job_name=q(plan.name),
        jobs_file=JOBS_FILE,
    )
    return {
        **run_files(plan),
        RUNTIME_ENV: dump_yaml(runtime_env(plan)),
        SUBMIT: submit,
        RAYJOB: rayjob(plan),
    }
