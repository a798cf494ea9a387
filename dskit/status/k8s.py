"""`dskit status RELEASE`: the pods of a Helm-installed run, by rank index, with phases and attempts.

Uses the `kubernetes` client (extra `k8s`), imported only here: rendering and training never need it.
With restartPolicy Never a restarted pod is a new pod, so "attempts" counts the pods of each index.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

from dskit.errors import SpecError

INDEX_KEY = "batch.kubernetes.io/job-completion-index"


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
        if st.terminated is not None and (s.name == "trainer" or st.terminated.exit_code):
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
    epoch = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    return sorted(rows, key=lambda r: (r.index if r.index is not None else 1 << 30, r.started or epoch))


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


def status_text(
    release: str, namespace: str, *, kubeconfig: str | None = None, context: str | None = None
) -> str:
    """The release's jobs and pods, as one text (printed by `status`, or above a run dir's rows)."""
    _check_name(release, "RELEASE", 53)
    _check_name(namespace, "--namespace", 63)
    core, batch = _clients(kubeconfig, context)
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    selector = f"app.kubernetes.io/name=dskit,app.kubernetes.io/instance={release}"
    try:
        jobs = batch.list_namespaced_job(namespace, label_selector=selector, _request_timeout=30).items
        pods = core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=30).items
    except ApiException as e:
        raise SpecError("dskit status", f"Kubernetes API: {e.status} {e.reason}") from None
    except (OSError, HTTPError) as e:  # urllib3 connection errors, retries exhausted
        reason = getattr(e, "reason", None) or e
        raise SpecError("dskit status", f"cannot reach the Kubernetes API: {reason}") from None
    except Exception as e:  # noqa: BLE001 - a server answering with a body the client cannot read
        raise SpecError(
            "dskit status", f"unreadable answer from the Kubernetes API: {type(e).__name__}: {e}"
        ) from None
    if not jobs:
        raise SpecError("RELEASE", f"no dskit job for release {release!r} in namespace {namespace!r}")
    try:
        return _release_text(jobs, pods)
    except Exception as e:  # noqa: BLE001 - objects missing fields a real API server always sets
        raise SpecError(
            "dskit status", f"unreadable answer from the Kubernetes API: {type(e).__name__}: {e}"
        ) from None


def _release_text(jobs: list[Any], pods: list[Any]) -> str:
    """Built whole before printing: a malformed answer prints nothing but the one error line."""
    lines = []
    for j in jobs:
        s = j.status
        conds = ", ".join(c.type for c in (s.conditions or []) if c.status == "True") or "running"
        lines.append(
            f"job {j.metadata.name}: {conds}; active {s.active or 0}, succeeded {s.succeeded or 0}, "
            f"failed {s.failed or 0} of backoffLimit {j.spec.backoff_limit}"
        )
    lines.append(format_table(pod_rows(pods)))
    return "\n".join(lines)
