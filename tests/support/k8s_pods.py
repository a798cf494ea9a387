"""Run the pods of a rendered dskit Job (or JobSet) as processes, the way a kubelet would, without Kubernetes.

What a kubelet does for each pod, and what this harness does instead:
- network: the pod's own IP, peers reachable        -> a network namespace on a private bridge
- hostname NAME-INDEX, JOB_COMPLETION_INDEX          -> a UTS namespace, the env var
- cluster DNS for NAME-INDEX.NAME (headless Service) -> a per-pod /etc/hosts, bind-mounted, editable
- volumes: ConfigMap, emptyDir (medium Memory),      -> files written from the rendered ConfigMap, a tmpfs
  PersistentVolumeClaim                                 of the emptyDir's sizeLimit, a shared host dir
- env: value, fieldRef, secretKeyRef; $(VAR) and $$   -> the same rules (`expand`)
- init containers to completion, then the container  -> the same order, exit codes returned
Everything runs in a private mount namespace, so mounts vanish with the processes. Images are not
pulled: the pods run this machine's Python (the plan's `runtime.python`).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tests.support.private_net import PrivateNet, alive, stop_pids

IMAGE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command, args and env values: $(VAR) from the container's env (left
    as is when undefined), $$ -> $."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def container_env(container: dict, *, labels: dict[str, str], secrets: dict[str, dict[str, str]]) -> dict:
    """The env a container sees: its `env` list in order (later entries may refer to earlier ones)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        ref = e["valueFrom"]
        if "fieldRef" in ref:
            m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", ref["fieldRef"]["fieldPath"])
            assert m, f"fieldRef {ref['fieldRef']['fieldPath']} not supported by the harness"
            env[e["name"]] = labels[m.group(1)]
        elif "secretKeyRef" in ref:
            s = ref["secretKeyRef"]
            env[e["name"]] = secrets[s["name"]][s["key"]]
        else:
            raise AssertionError(f"valueFrom {ref} not supported by the harness")
    return env


class Pods:
    """The pods of one Indexed Job, on hosts 1..N of a private network (pod index i on host i+1)."""

    def __init__(
        self,
        base: Path,
        job: dict,
        config_maps: dict[str, dict],
        claims: dict[str, str],
        *,
        prefix: str = "dkp",
        net: str = "192.168.214",
        namespace: str = "default",
    ):
        self.base, self.job, self.config_maps, self.claims = Path(base), job, config_maps, claims
        self.name = job["metadata"]["name"]
        self.spec = job["spec"]["template"]["spec"]
        self.subdomain = self.spec["subdomain"]
        self.nodes = job["spec"]["completions"]
        self.namespace = namespace
        self.net = PrivateNet(prefix, net, hosts=self.nodes)
        self.uid = "8f1c1d3e-dskit-test"
        self.procs: dict[int, subprocess.Popen] = {}
        self.made_dirs: list[Path] = []

    # ------------------------------------------------------------------ names
    def hostname(self, i: int) -> str:
        return f"{self.name}-{i}"

    def dns_name(self, i: int) -> str:
        return f"{self.hostname(i)}.{self.subdomain}"

    def fqdn(self, i: int) -> str:
        return f"{self.dns_name(i)}.{self.namespace}.svc.cluster.local"

    def hosts_file(self, i: int) -> Path:
        return self.base / f"pod-{i}" / "hosts"

    def publish(self, indexes) -> None:
        """Make pods' DNS names resolve everywhere (the headless Service's records), in place."""
        self.published = sorted(set(getattr(self, "published", [])) | set(indexes))
        for i in range(self.nodes):
            # the kubelet's own entry (the pod's FQDN first: socket.getfqdn(), which torchrun hands to
            # the ranks as MASTER_ADDR), then cluster DNS: the short and the full Service names
            lines = ["127.0.0.1 localhost", f"{self.net.addr(i + 1)} {self.fqdn(i)} {self.hostname(i)}"]
            lines += [f"{self.net.addr(j + 1)} {self.dns_name(j)} {self.fqdn(j)}" for j in self.published]
            path = self.hosts_file(i)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:  # in place: the pods bind-mount this inode
                f.write("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> None:
        # Mount points the containers need but this machine lacks (/etc/dskit, /run/dskit), made once
        # here, before any pod thread runs, and removed by down().
        for c in [*self.spec.get("initContainers", []), *self.spec["containers"]]:
            for m in c.get("volumeMounts", []):
                self._mountpoint(Path(m["mountPath"]))
        self.net.up()
        self.publish([])

    def down(self) -> None:
        stop_pids([p.pid for p in self.procs.values() if p.poll() is None])
        self.net.down()
        for d in reversed(self.made_dirs):
            try:
                d.rmdir()
            except OSError:
                pass

    # ------------------------------------------------------------------ running
    def _mount_script(self, i: int, container: dict, attempt: int) -> str:
        """Shell lines that build the pod's filesystem view inside its own mount namespace."""
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        pod_dir = self.base / f"pod-{i}"
        lines = [
            f"hostname {shlex.quote(self.hostname(i))}",
            f"mount --bind {shlex.quote(str(self.hosts_file(i)))} /etc/hosts",
        ]
        for m in container.get("volumeMounts", []):
            v, target = volumes[m["name"]], m["mountPath"]
            if "configMap" in v:
                src = pod_dir / "configmaps" / v["configMap"]["name"]
                src.mkdir(parents=True, exist_ok=True)
                for key, text in self.config_maps[v["configMap"]["name"]]["data"].items():
                    (src / key).write_text(text)
                lines.append(f"mount --bind {shlex.quote(str(src))} {shlex.quote(target)}")
            elif "emptyDir" in v and v["emptyDir"].get("medium") == "Memory":
                size = v["emptyDir"]["sizeLimit"]
                lines.append(f"mount -t tmpfs -o size={shlex.quote(str(size))} tmpfs {shlex.quote(target)}")
            elif "emptyDir" in v:  # pod-local and fresh for every pod (attempt)
                src = pod_dir / f"attempt-{attempt}" / v["name"]
                src.mkdir(parents=True, exist_ok=True)
                lines.append(f"mount --bind {shlex.quote(str(src))} {shlex.quote(target)}")
            elif "persistentVolumeClaim" in v:
                src = self.claims[v["persistentVolumeClaim"]["claimName"]]
                if os.path.realpath(src) != os.path.realpath(target):
                    lines.append(f"mount --bind {shlex.quote(src)} {shlex.quote(target)}")
            else:
                raise AssertionError(f"volume {v} not supported by the harness")
            if m.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        return "\n".join(lines)

    def _mountpoint(self, path: Path) -> None:
        missing = [p for p in (path, *path.parents) if not p.exists()]
        for p in reversed(missing):
            p.mkdir()
            self.made_dirs.append(p)

    def start(
        self, i: int, container: dict, *, attempt: int = 0, secrets=None, log: Path
    ) -> subprocess.Popen:
        labels = {
            "batch.kubernetes.io/controller-uid": self.uid,
            "batch.kubernetes.io/job-completion-index": str(i),
        }
        env = container_env(container, labels=labels, secrets=secrets or {})
        argv = [expand(w, env) for w in container.get("command", []) + container.get("args", [])]
        full_env = {**IMAGE_ENV, "HOSTNAME": self.hostname(i), "JOB_COMPLETION_INDEX": str(i), **env}
        script = self._mount_script(i, container, attempt) + '\nexec "$@"\n'
        workdir = container.get("workingDir") or tempfile.mkdtemp(prefix=f"pod{i}-", dir=self.base)
        cmd = [
            *self.net.enter(i + 1),
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "bash",
            "-c",
            script,
            "pod",
            *argv,
        ]
        f = open(log, "ab")
        proc = subprocess.Popen(cmd, env=full_env, cwd=workdir, stdout=f, stderr=subprocess.STDOUT)
        f.close()
        self.procs[i] = proc
        return proc

    def run_pod(self, i: int, *, attempt: int = 0, secrets=None) -> PodRun:
        """Start pod i in the background: its init containers to completion, then its container."""
        return PodRun(self, i, attempt=attempt, secrets=secrets)

    def log_path(self, i: int) -> Path:
        return self.base / f"pod-{i}.log"

    def log(self, i: int) -> str:
        p = self.log_path(i)
        return p.read_text(errors="replace") if p.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- pod {i}\n{self.log(i)[-4000:]}" for i in range(self.nodes))


class PodRun:
    """One pod's life: phase Init -> Running -> Succeeded | Failed, like the Pod status a kubelet reports."""

    def __init__(self, pods: Pods, i: int, *, attempt: int, secrets):
        self.pods, self.i, self.attempt, self.secrets = pods, i, attempt, secrets
        self.phase, self.exit_code, self.main = "Init", None, None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._run_containers()
        except BaseException as e:  # a harness error must fail the pod, not leave it "Init" forever
            self.error, self.phase = e, "Failed"
            raise

    def _run_containers(self) -> None:
        log = self.pods.log_path(self.i)
        spec = self.pods.spec
        for init in spec.get("initContainers", []):
            p = self.pods.start(self.i, init, attempt=self.attempt, secrets=self.secrets, log=log)
            if p.wait() != 0:
                self.exit_code, self.phase = p.returncode, "Failed"
                return
        (container,) = spec["containers"]
        self.main = self.pods.start(self.i, container, attempt=self.attempt, secrets=self.secrets, log=log)
        self.phase = "Running"
        code = self.main.wait()
        self.exit_code, self.phase = code, "Succeeded" if code == 0 else "Failed"

    @property
    def done(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def terminate(self) -> None:
        """What a kubelet does on preemption or `kubectl delete pod`: SIGTERM to the container's PID 1."""
        assert self.main is not None, f"pod {self.i} has no running container ({self.phase})"
        os.kill(self.main.pid, signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """The pod's exit code; like `wait_for`, `timeout` is how long it may go without new output."""
        wait_for(lambda: not self._thread.is_alive(), timeout, f"pod {self.i} exit", self.pods, quiet=True)
        if self.error is not None:
            raise AssertionError(f"pod {self.i}: the harness failed") from self.error
        if not self.done:
            raise TimeoutError(f"pod {self.i} still {self.phase} after {timeout}s\n{self.pods.logs()}")
        return self.exit_code


def wait_for(predicate, timeout: float, what: str, pods: Pods, *, quiet: bool = False) -> None:
    """Wait as long as the pods make progress: fail after `timeout` seconds without new log output
    (a hang), or after 4 x `timeout` in all. On a loaded machine a slow start still logs as it goes.
    `quiet`: return at the deadline instead of raising (the caller reports)."""
    start = last_change = time.time()
    seen = -1
    while True:
        if predicate():
            return
        now = time.time()
        size = sum(pods.log_path(i).stat().st_size for i in range(pods.nodes) if pods.log_path(i).exists())
        if size != seen:
            seen, last_change = size, now
        if now - last_change > timeout or now - start > 4 * timeout:
            if quiet:
                return
            stalled = now - last_change > timeout
            raise TimeoutError(
                f"{what} not reached: {'no new pod output for' if stalled else 'still progressing after'} "
                f"{now - last_change if stalled else now - start:.0f}s\n{pods.logs()}"
            )
        time.sleep(0.3)


class JobController:
    """The part of Kubernetes' Job controller these tests need, for an Indexed Job with restartPolicy
    Never: one pod per index; a failed pod is replaced by a new one (the next attempt) unless the
    podFailurePolicy says FailJob; failures the policy Counts (not Ignores) are limited by
    backoffLimit; the Job completes when every index has succeeded. A pod lost with its node carries
    the DisruptionTarget condition, which the policy's onPodConditions rule matches."""

    def __init__(self, pods: Pods):
        self.pods, self.job = pods, pods.job
        self.failures = 0
        self.history: list[tuple[int, int, int, str]] = []  # (index, attempt, exit code, action)
        self.runs: dict[int, PodRun] = {}
        self.disrupted: set[tuple[int, int]] = set()
        self.result: str | None = None

    def lose_node(self, i: int) -> None:
        """Pod i's node dies: every process of the pod is gone at once, no SIGTERM, no grace."""
        self.disrupted.add((i, self.runs[i].attempt))
        stop_pids(self.pods.net.pids(i + 1), grace=0)

    def run(self, timeout: float) -> str:
        deadline = time.time() + timeout
        self.runs = {i: self.pods.run_pod(i) for i in range(self.pods.nodes)}
        succeeded: set[int] = set()
        while time.time() < deadline:
            for i, run in list(self.runs.items()):
                if i in succeeded or not run.done:
                    continue
                if run.error is not None:
                    raise AssertionError(f"pod {i}: the harness failed") from run.error
                if run.exit_code == 0:
                    succeeded.add(i)
                    continue
                if (i, run.attempt) in self.disrupted:
                    action = _condition_action(self.job, "DisruptionTarget")
                else:
                    action = failure_action(self.job, run.exit_code)
                self.history.append((i, run.attempt, run.exit_code, action))
                if action == "Count":
                    self.failures += 1
                if action == "FailJob" or self.failures > self.job["spec"]["backoffLimit"]:
                    stop_pids([p.pid for p in self.pods.procs.values() if p.poll() is None])
                    self.result = "Failed"
                    return self.result
                self.runs[i] = self.pods.run_pod(i, attempt=run.attempt + 1)
            if len(succeeded) == self.pods.nodes:
                self.result = "Complete"
                return self.result
            time.sleep(0.3)
        raise TimeoutError(f"job not finished after {timeout}s: {self.history}\n{self.pods.logs()}")


def jobset_child(jobset: dict, job_index: int = 0) -> dict:
    """The Job the JobSet controller creates from the JobSet's (one) replicated job: named
    <jobset>-<replicated job>-<job index>, its pods in the subdomain of spec.network (the headless
    Service the controller makes)."""
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{jobset['metadata']['name']}-{rjob['name']}-{job_index}"},
        "spec": rjob["template"]["spec"],
    }
    job["spec"]["template"]["spec"]["subdomain"] = jobset["spec"]["network"]["subdomain"]
    return job


def job_failure(
    job: dict, pod: str, exit_code: int, *, disrupted: bool, counted: int
) -> tuple[str, str] | None:
    """The (reason, message) of the Failed condition the Job controller gives `job` when its pod `pod`
    fails (exit_code, or lost with its node: `disrupted`) after `counted` earlier counted failures;
    None if the Job goes on. The messages are the Job controller's (pkg/controller/job/pod_failure_policy.go)."""
    for index, rule in enumerate(job["spec"].get("podFailurePolicy", {}).get("rules", [])):
        on = rule.get("onExitCodes")
        if on and on.get("containerName", "trainer") == "trainer":
            matched = (on["operator"] == "In") == (exit_code in on["values"])
            what = f"Container trainer for pod default/{pod} failed with exit code {exit_code}"
        elif rule.get("onPodConditions") and disrupted:
            matched = any(c["type"] == "DisruptionTarget" for c in rule["onPodConditions"])
            what = f"Pod default/{pod} has condition DisruptionTarget"
        else:
            continue
        if not matched:
            continue
        if rule["action"] == "FailJob":
            return "PodFailurePolicy", f"{what} matching FailJob rule at index {index}"
        if rule["action"] == "Ignore":
            return None
        break  # Count
    if counted + 1 > job["spec"].get("backoffLimit", 6):
        return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    return None


def jobset_action(jobset: dict, reason: str, message: str) -> tuple[str, str]:
    """(rule name, action) of the JobSet's first failurePolicy rule matching a child Job's failure
    (its reasons listed, one of its message patterns found, as Go's regexp.MatchString); none: the
    controller's default, RestartJobSet."""
    for rule in jobset["spec"].get("failurePolicy", {}).get("rules", []):
        reasons, patterns = rule.get("onJobFailureReasons", []), rule.get("onJobFailureMessagePatterns", [])
        if (not reasons or reason in reasons) and (
            not patterns or any(re.search(p, message) for p in patterns)
        ):
            return rule["name"], rule["action"]
    return "(default)", "RestartJobSet"


class JobSetController:
    """The part of the JobSet controller these tests need, over the pods of its one child Job: the
    Job fails by its podFailurePolicy and backoffLimit (`job_failure`); the JobSet's failurePolicy
    decides (`jobset_action`): FailJobSet ends it; RestartJobSet (counted against maxRestarts) and
    RestartJobSetAndIgnoreMaxRestarts recreate every pod, the BlockingRecreate way: the old pods get
    SIGTERM (their deletion) and all have exited before the next attempt's pods start."""

    def __init__(self, pods: Pods, jobset: dict):
        self.pods, self.jobset, self.job = pods, jobset, pods.job
        self.max_restarts = jobset["spec"].get("failurePolicy", {}).get("maxRestarts", 0)
        self.restarts = self.counted = 0
        #: (index, attempt, exit code, child Job's failure reason, JobSet rule, action)
        self.history: list[tuple[int, int, int, str, str, str]] = []
        self.runs: dict[int, PodRun] = {}
        self.disrupted: set[tuple[int, int]] = set()
        self.result: str | None = None

    def preempt(self, i: int) -> None:
        """Pod i is preempted: it carries the DisruptionTarget condition and its container gets SIGTERM."""
        self.disrupted.add((i, self.runs[i].attempt))
        self.runs[i].terminate()

    def _recreate(self, attempt: int) -> None:
        alive_now = [p.pid for p in self.pods.procs.values() if p.poll() is None]
        for pid in alive_now:
            os.kill(pid, signal.SIGTERM)
        for run in self.runs.values():
            run.wait(120)
        self.runs = {i: self.pods.run_pod(i, attempt=attempt) for i in range(self.pods.nodes)}

    def run(self, timeout: float) -> str:
        deadline, attempt, counted_failures = time.time() + timeout, 0, 0
        self.runs = {i: self.pods.run_pod(i) for i in range(self.pods.nodes)}
        while time.time() < deadline:
            done = {i: r for i, r in self.runs.items() if r.done}
            for run in done.values():
                if run.error is not None:
                    raise AssertionError(f"pod {run.i}: the harness failed") from run.error
            if len(done) == self.pods.nodes and all(r.exit_code == 0 for r in done.values()):
                self.result = "Completed"
                return self.result
            failed = next((r for r in done.values() if r.exit_code != 0), None)
            if failed is None:
                time.sleep(0.3)
                continue
            pod = f"{self.pods.hostname(failed.i)}-a{attempt}"
            disrupted = (failed.i, failed.attempt) in self.disrupted
            failure = job_failure(
                self.job, pod, failed.exit_code, disrupted=disrupted, counted=counted_failures
            )
            assert failure is not None, "a JobSet's child Job fails at its first failed pod (backoffLimit 0)"
            name, action = jobset_action(self.jobset, *failure)
            self.history.append((failed.i, attempt, failed.exit_code, failure[0], name, action))
            if action == "FailJobSet" or (action == "RestartJobSet" and self.counted >= self.max_restarts):
                stop_pids([p.pid for p in self.pods.procs.values() if p.poll() is None])
                self.result = "Failed"
                return self.result
            self.counted += action == "RestartJobSet"
            self.restarts += 1
            attempt += 1
            self._recreate(attempt)
        raise TimeoutError(f"jobset not finished after {timeout}s: {self.history}\n{self.pods.logs()}")


def _condition_action(job: dict, condition: str) -> str:
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        if any(c["type"] == condition for c in rule.get("onPodConditions", [])):
            return rule["action"]
    return "Count"


def failure_action(job: dict, exit_code: int, container: str = "trainer") -> str:
    """What the Job controller does with a pod that failed with `exit_code`: the first matching
    podFailurePolicy rule's action, else Count (against backoffLimit)."""
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        on = rule.get("onExitCodes")
        if not on or on.get("containerName", container) != container:
            continue
        hit = exit_code in on["values"]
        if (on["operator"] == "In") == hit:
            return rule["action"]
    return "Count"


__all__ = [
    "JobController",
    "JobSetController",
    "job_failure",
    "jobset_action",
    "jobset_child",
    "PodRun",
    "Pods",
    "alive",
    "container_env",
    "expand",
    "failure_action",
    "wait_for",
]
