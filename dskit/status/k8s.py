"""`dskit status RELEASE`: the pods of a Helm-installed run, by rank index, with phases and attempts.

Uses the `kubernetes` client (extra `k8s`), imported only here: rendering and training never need it.
With restartPolicy Never a restarted pod is a new pod, so "attempts" counts the pods of each index.
The workload is a Job, a JobSet (its state and restarts, counted and not) or a TrainJob (its
conditions); under each, the trainer's verdict: what dskit's launcher made of the ranks' exit codes
in the latest pods that ended (contract.exit_verdict), as the Job's podFailurePolicy reads it.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

from dskit.errors import EXIT_BAD_INPUT, SpecError
from dskit.io.text import escape
from dskit.launch.contract import EXIT_DISK_FULL, EXIT_REQUEUE, exit_verdict

INDEX_KEY = "batch.kubernetes.io/job-completion-index"
#: the trainer's container: "trainer" in the chart's pods, "node" in a TrainJob's (its runtime's name)
TRAINER_CONTAINERS = ("trainer", "node")
#: (group, version, plural) of the custom workloads, by the chart's `workload` value
CUSTOM = {
    "jobset": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    "trainjob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
}
VERDICTS = {
    EXIT_BAD_INPUT: f"bad input (exit {EXIT_BAD_INPUT}): a retry cannot help",
    EXIT_DISK_FULL: f"checkpoint disk full (exit {EXIT_DISK_FULL}): a retry cannot help",
    EXIT_REQUEUE: f"checkpointed and stopped (exit {EXIT_REQUEUE}): a restart resumes, not counted",
}


_EPOCH = dt.datetime.min.replace(tzinfo=dt.timezone.utc)


@dataclass(frozen=True)
class PodRow:
    index: int | None
    name: str
    phase: str
    detail: str  # why it is waiting, or how the trainer container ended
    node: str
    started: dt.datetime | None


def _detail(pod: Any) -> str:
    statuses = [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]
    for s in reversed(statuses):
        st = s.state
        if st is None:
            continue
        if st.terminated is not None and (s.name in TRAINER_CONTAINERS or st.terminated.exit_code):
            return f"{s.name} exited {st.terminated.exit_code} ({st.terminated.reason or 'no reason'})"
        if st.waiting is not None:
            return f"{s.name} waiting: {st.waiting.reason or '?'}"
        if st.running is not None:
            return f"{s.name} running"
    conditions = [
        c for c in (pod.status.conditions or []) if c.status == "True" and c.type == "DisruptionTarget"
    ]
    return f"disrupted: {conditions[0].reason}" if conditions else ""


def pod_rows(pods: list[Any]) -> list[PodRow]:
    rows = []
    for p in pods:
        meta = p.metadata
        raw = (meta.annotations or {}).get(INDEX_KEY) or (meta.labels or {}).get(INDEX_KEY)
        rows.append(
            PodRow(
                index=int(raw) if raw is not None else None,
                name=meta.name,
                phase=p.status.phase or "Unknown",
                detail=_detail(p),
                node=p.spec.node_name or "-",
                started=meta.creation_timestamp,
            )
        )
    return sorted(rows, key=lambda r: (r.index if r.index is not None else 1 << 30, r.started or _EPOCH))


def format_table(rows: list[PodRow]) -> str:
    attempts: dict[int | None, int] = {}
    for r in rows:
        attempts[r.index] = attempts.get(r.index, 0) + 1
    header = ("RANK-INDEX", "ATTEMPTS", "POD", "PHASE", "NODE", "DETAIL")
    lines = [header]
    for r in rows:
        idx = "-" if r.index is None else str(r.index)
        lines.append((idx, str(attempts[r.index]), r.name, r.phase, r.node, r.detail))
    widths = [max(len(line[c]) for line in lines) for c in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths, strict=True)) + "  " + line[-1]
        for line in lines
    )


def _clients(kubeconfig: str | None, context: str | None):
    try:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
    except ImportError:
        raise SpecError("dskit status", "needs the Kubernetes client: pip install 'dskit[k8s]'") from None
    try:
        config.load_kube_config(config_file=kubeconfig, context=context)
    except Exception as e:  # noqa: BLE001 - the client's parser raises anything on a garbage file
        if kubeconfig or context or not isinstance(e, (ConfigException, FileNotFoundError)):
            raise SpecError("--kubeconfig", f"cannot load it: {e}") from None
        try:
            config.load_incluster_config()
        except ConfigException:
            raise SpecError(
                "--kubeconfig",
                "no Kubernetes configuration: set KUBECONFIG, pass --kubeconfig, or run in a pod",
            ) from None
    return client.CoreV1Api(), client.BatchV1Api()


def _custom_api() -> Any:
    """The client for JobSets and TrainJobs (after _clients loaded the configuration)."""
    from kubernetes import client

    return client.CustomObjectsApi()


#: A Helm release and a namespace are DNS-1123 labels (at most 53 and 63 characters: Helm and Kubernetes).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _check_name(value: str, field: str, longest: int) -> None:
    if len(value) > longest or not _DNS_LABEL.fullmatch(value):
        raise SpecError(
            field,
            f"{value!r} is not a Kubernetes name: lowercase a-z, 0-9 and '-', starting and ending with a "
            f"letter or digit, at most {longest} characters",
        )


def status(release: str, namespace: str, *, kubeconfig: str | None = None, context: str | None = None) -> int:
    print(status_text(release, namespace, kubeconfig=kubeconfig, context=context))
    return 0


def _custom(kinds: list[str], namespace: str, selector: str) -> list[tuple[str, dict]]:
    """The release's JobSets and TrainJobs, as the API's dicts. A kind whose CRD the cluster lacks
    (404), or that the user may not list (403: a Role for Jobs and pods only), has none when a bare
    release is asked about; asked about because the run was rendered for it, that is the answer's error."""
    from kubernetes.client.exceptions import ApiException

    found, api = [], _custom_api() if kinds else None
    for kind in kinds:
        group, version, plural = CUSTOM[kind]
        try:
            answer = api.list_namespaced_custom_object(
                group, version, namespace, plural, label_selector=selector, _request_timeout=30
            )
        except ApiException as e:
            if e.status in (403, 404) and len(kinds) > 1:
                continue
            if e.status == 404:
                raise SpecError(
                    "dskit status", f"the cluster has no {plural}.{group} (is {kind} installed?)"
                ) from None
            raise
        found += [(kind, item) for item in answer.get("items", [])]
    return found


def status_text(
    release: str,
    namespace: str,
    *,
    workload: str | None = None,
    kubeconfig: str | None = None,
    context: str | None = None,
) -> str:
    """The release's workload, jobs and pods, as one text (printed by `status`, or above a run dir's
    rows). `workload`: the kind the run was rendered for (None, a bare release: any of them)."""
    _check_name(release, "RELEASE", 53)
    _check_name(namespace, "--namespace", 63)
    core, batch = _clients(kubeconfig, context)
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    selector = f"app.kubernetes.io/name=dskit,app.kubernetes.io/instance={release}"
    # a bare release may be any kind; a run dir's is the one it was rendered for (a Job: none custom)
    kinds = list(CUSTOM) if workload is None else [k for k in CUSTOM if k == workload]
    try:
        jobs = batch.list_namespaced_job(namespace, label_selector=selector, _request_timeout=30).items
        pods = core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=30).items
        groups = _custom(kinds, namespace, selector)
    except ApiException as e:
        raise SpecError("dskit status", f"Kubernetes API: {e.status} {e.reason}") from None
    except (OSError, HTTPError) as e:  # urllib3 connection errors, retries exhausted
        reason = getattr(e, "reason", None) or e
        raise SpecError("dskit status", f"cannot reach the Kubernetes API: {reason}") from None
    except Exception as e:  # noqa: BLE001 - a server answering with a body the client cannot read
        raise SpecError(
            "dskit status", f"unreadable answer from the Kubernetes API: {type(e).__name__}: {e}"
        ) from None
    if not jobs and not groups:
        raise SpecError("RELEASE", f"no dskit workload for release {release!r} in namespace {namespace!r}")
    try:
        return _release_text(jobs, pods, groups)
    except Exception as e:  # noqa: BLE001 - objects missing fields a real API server always sets
        raise SpecError(
            "dskit status", f"unreadable answer from the Kubernetes API: {type(e).__name__}: {e}"
        ) from None


def _true_conditions(status: dict) -> list[dict]:
    return [c for c in status.get("conditions") or [] if c.get("status") == "True"]


def _group_line(kind: str, obj: dict) -> str:
    """A JobSet's state and restarts, or a TrainJob's conditions, with the reason of an end."""
    status, name = obj.get("status") or {}, obj["metadata"]["name"]
    conds = _true_conditions(status)
    state = ", ".join(c["type"] for c in conds) or (
        "suspended" if (obj.get("spec") or {}).get("suspend") else "running"
    )
    ended = next((c for c in conds if c["type"] in ("Failed", "Completed", "Complete")), None)
    # the cluster's words, escaped: a message may hold anything
    why = (
        f" ({escape(str(ended.get('reason', '?')))}: {escape(str(ended.get('message', '')))})"
        if ended
        else ""
    )
    if kind == "jobset":
        most = ((obj.get("spec") or {}).get("failurePolicy") or {}).get("maxRestarts", 0)
        restarts, counted = status.get("restarts", 0), status.get("restartsCountTowardsMax", 0)
        return f"jobset {name}: {state}{why}; restarts {restarts} ({counted} counted of maxRestarts {most})"
    return f"trainjob {name}: {state}{why}"


def verdict(pods: list[Any]) -> str | None:
    """What dskit's launcher made of the latest ended pods' trainer exit codes (None: none ended):
    per rank index, the newest pod whose trainer container terminated."""
    latest: dict[int | None, tuple[Any, int]] = {}
    for p in pods:
        for s in p.status.container_statuses or []:
            if s.name in TRAINER_CONTAINERS and s.state is not None and s.state.terminated is not None:
                row = pod_rows([p])[0]
                seen = latest.get(row.index)
                if seen is None or (row.started or _EPOCH) >= (seen[0].started or _EPOCH):
                    latest[row.index] = (row, s.state.terminated.exit_code)
    codes = {code for _, code in latest.values()}
    if not codes:
        return None
    code = exit_verdict(codes)
    if code is not None:
        return VERDICTS[code]
    if codes == {0}:
        return "completed (exit 0 on every pod)"
    return f"failed (exit {', '.join(map(str, sorted(codes)))}): counts against failure.maxRestarts"


def _release_text(jobs: list[Any], pods: list[Any], groups: list[tuple[str, dict]] = ()) -> str:
    """Built whole before printing: a malformed answer prints nothing but the one error line."""
    lines = [_group_line(kind, obj) for kind, obj in groups]
    for j in jobs:
        s = j.status
        conds = ", ".join(c.type for c in (s.conditions or []) if c.status == "True") or "running"
        lines.append(
            f"job {j.metadata.name}: {conds}; active {s.active or 0}, succeeded {s.succeeded or 0}, "
            f"failed {s.failed or 0} of backoffLimit {j.spec.backoff_limit}"
        )
    if (said := verdict(pods)) is not None:
        lines.append(f"verdict: {said}")
    lines.append(format_table(pod_rows(pods)))
    return "\n".join(lines)
