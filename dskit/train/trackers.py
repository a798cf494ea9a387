"""Experiment trackers (rank 0): TensorBoard, MLflow and Weights & Biases, any combination, each fed the
records metrics.jsonl and eval.jsonl get (LogWindow, Evaluator), so no figure is computed twice.

The plan's `tracking` section says which are on (run.yaml leaves it out: TensorBoard alone). A tracker
must never stop training: one that cannot start (its package missing, its server unreachable, no
credentials) or fails mid-run warns once, in one line naming it and the reason, and is dropped.
Credentials never pass through dskit: MLflow and W&B read their own environment variables
(MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD, WANDB_API_KEY).

A process resumed from a checkpoint logs to the same MLflow and W&B runs: their ids are kept in
OUTPUT_DIR/tracker-runs.json. A fresh start (no checkpoint) starts new runs, whatever that file holds.

A tracking URI may carry a credential (MLFLOW_TRACKING_URI=https://user:pass@host is not checked as the
spec's field is, and MLflow's errors begin with the request's URL): no URI is stored with its userinfo,
query or fragment (public_uri), and every line the trackers log passes through redact().
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import string
import threading
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from dskit.io.bounded_read import KiB, read_json
from dskit.launch import env_vars
from dskit.plan.schema import Plan
from dskit.spec.tracking import MlflowSpec, TrackingSpec, WandbSpec
from dskit.train.tensorboard import TensorBoardLog

log = logging.getLogger("dskit.train")

RUNS_FILE = "tracker-runs.json"
RUNS_FILE_LIMIT = 16 * KiB
#: metrics.jsonl keys that are no metric: the trackers' own axes (step, wall time) and a restart marker
NOT_METRICS = frozenset(("step", "time", "resumed_from"))
#: per-expert token counts (layers x experts): a histogram where the tracker has one (TensorBoard, W&B);
#: as MLflow series they would be one per expert and layer (14,848 on DeepSeek-V3)
COUNTS = "expert_counts"
#: MLflow's HTTP client retries 7 times with backoff by default, minutes against a server that is down;
#: these bound a start or a log step to about half a minute, unless the environment sets them.
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
MLFLOW_BATCH = 1000  # metrics per log_batch request (MLflow's limit)
MLFLOW_PARAMS_BATCH = 100  # params per log_batch request (MLflow's limit)
MLFLOW_PARAM_CHARS = 6000  # MLflow's longest param value
REASON_CHARS = 200  # of an exception's text in a warning
_ERRNO = re.compile(r"\[Errno -?[0-9]+\][^'\"()]*")
WANDB_INIT_TIMEOUT_S = 30  # how long wandb.init may wait for the W&B server (its default: 90 s)
#: how long run.finish() may upload before the process goes on (wandb's default: no limit): against a
#: server gone away it would outlast a pod's termination grace period, turning a clean exit (0, or 75 to
#: be requeued) into a SIGKILL (137). What is left stays under OUTPUT_DIR/wandb for `wandb sync`.
WANDB_FINISH_TIMEOUT_S = 30
#: W&B's x axis: the trainer's step as a metric. wandb's own step (`log(step=)`) must only grow, and a
#: resumed run continues from its last one, so a resume from an older checkpoint would lose its records.
WANDB_STEP = "trainer/step"
#: scheme://userinfo@ in any text: the userinfo (user:password, a token) is replaced
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s?#]*@")


class Tracker(Protocol):
    name: str

    def write(self, rec: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TrackerOff(Exception):
    """A tracker that cannot run here, with the reason (one line) why."""


def tracker_metrics(rec: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl (or eval.jsonl) record as tracker metrics: each number under its key, each
    per-MoE-layer list as KEY/moe_layer_I. Left out: NOT_METRICS, None (no MFU without a peak: nothing
    made up) and the per-expert counts (COUNTS)."""
    out: dict[str, float] = {}
    for key, v in rec.items():
        if key in NOT_METRICS or key == COUNTS or v is None or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[key] = float(v)
        elif isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
            out.update({f"{key}/moe_layer_{i}": float(x) for i, x in enumerate(v)})
    return out


def plan_params(plan: Plan) -> dict[str, Any]:
    """The plan as flat `section.field` parameters, logged once per tracker run: what was trained, on
    what, split how, and what the plan predicted. The model's config.json and the DeepSpeed config stay
    in run.yaml (hundreds of keys)."""
    out: dict[str, Any] = {"name": plan.name}
    for section in ("model", "hardware", "parallel", "optim", "run", "launch", "finetune"):
        part = getattr(plan, section)
        if part is None:
            continue
        for key, v in part.model_dump(mode="json").items():
            if (section, key) != ("model", "config"):
                out[f"{section}.{key}"] = v
    out["predicted.memory_gib"] = plan.memory.get("total_gib")
    if plan.speed:
        out["predicted.tokens_per_s_per_gpu"] = plan.speed.get("tokens_per_s_per_gpu")
        out["predicted.mfu"] = plan.speed.get("mfu")
    return out


def param_text(v: Any) -> str:
    """A parameter value as MLflow stores it (text): strings as they are, anything else as JSON."""
    return (v if isinstance(v, str) else json.dumps(v))[:MLFLOW_PARAM_CHARS]


def redact(text: str) -> str:
    """`text` with the userinfo of every URL in it (scheme://user:password@) replaced by `***`."""
    return _USERINFO.sub(r"\1***@", text)


def public_uri(uri: str) -> str:
    """A URI with its userinfo, query and fragment removed: the part that may be stored."""
    parts = urlsplit(uri)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def reason(e: BaseException) -> str:
    """An exception as one short, redacted line: MLflow's HTTP errors begin with the request's URL, run
    over several lines and hundreds of characters, with the cause (`[Errno 111] Connection refused`) at
    the end, kept here."""
    if isinstance(e, TrackerOff):
        return redact(str(e))
    text = redact(" ".join(str(e).split()))
    short = f"{type(e).__name__}: {text[:REASON_CHARS]}" if text else type(e).__name__
    errno = _ERRNO.search(text)
    if errno and errno.group() not in short:
        short += f" ... {errno.group().strip()}"
    return short


class RunIds:
    """OUTPUT_DIR/tracker-runs.json: each tracker's run id, written when the run is created, read when
    a process resumed from a checkpoint starts, so one training run is one tracker run. A fresh start
    (`resumed` False: an empty checkpoint dir, the same output dir) removes it: new runs. Rank 0 alone
    reads and writes it."""

    def __init__(self, output_dir: str | Path, resumed: bool):
        self.path = Path(output_dir) / RUNS_FILE
        self.ids: dict[str, Any] = {}
        if not resumed:
            self.path.unlink(missing_ok=True)
        elif self.path.is_file():
            try:
                got = read_json(self.path, limit=RUNS_FILE_LIMIT, what="tracker run ids")
                self.ids = got if isinstance(got, dict) else {}
            except (OSError, ValueError) as e:  # damaged: new tracker runs, never a failed start
                log.warning("%s unreadable (%s): the trackers start new runs", self.path, redact(str(e)))

    def get(self, tracker: str) -> dict[str, Any]:
        got = self.ids.get(tracker)
        return got if isinstance(got, dict) else {}

    def set(self, tracker: str, ids: dict[str, Any]) -> None:
        self.ids[tracker] = ids
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.ids, indent=1) + "\n")
        os.replace(tmp, self.path)


class MlflowTracker:
    """Metrics by MlflowClient.log_batch, one request per record; the plan's parameters once per run."""

    name = "MLflow"

    def __init__(self, cfg: MlflowSpec, plan: Plan, runs: RunIds):
        for var, default in MLFLOW_HTTP.items():
            os.environ.setdefault(var, default)
        # urllib3 logs each of those retries as a warning: the tracker's own line says what happened
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Metric, Param
        except ImportError as e:
            raise TrackerOff(
                f"the mlflow package is not installed (pip install 'dskit[track]'): {e}"
            ) from None
        self.Metric = Metric
        uri = cfg.tracking_uri or env_vars.read("MLFLOW_TRACKING_URI")
        if not uri:
            raise TrackerOff(
                "no tracking.mlflow.tracking_uri and no MLFLOW_TRACKING_URI in the trainer's environment"
            )
        self.client = MlflowClient(tracking_uri=uri)
        self.steps = plan.optim.steps
        self.last_step = 0
        saved = runs.get("mlflow")
        if saved.get("tracking_uri") == public_uri(uri) and self._reopen(saved.get("run_id")):
            self.run_id = saved["run_id"]
            return
        exp = self.client.get_experiment_by_name(cfg.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=cfg.run_name).info.run_id
        params = [Param(k, param_text(v)) for k, v in plan_params(plan).items()]
        for i in range(0, len(params), MLFLOW_PARAMS_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_PARAMS_BATCH])
        runs.set("mlflow", {"tracking_uri": public_uri(uri), "run_id": self.run_id})

    def _reopen(self, run_id: str | None) -> bool:
        """Continue the run an earlier process of this job created (its parameters are already there:
        MLflow keeps a parameter's first value, and a resume at another world size changes some)."""
        if not isinstance(run_id, str):
            return False
        try:
            self.client.get_run(run_id)
        except Exception:  # deleted, or another server's: a new run
            return False
        self.client.update_run(run_id, status="RUNNING")
        return True

    def write(self, rec: dict[str, Any]) -> None:
        ms = int(rec.get("time", time.time()) * 1000)
        step = rec["step"]
        metrics = [self.Metric(k, v, ms, step) for k, v in tracker_metrics(rec).items()]
        for i in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MLFLOW_BATCH])
        self.last_step = max(self.last_step, step)

    def close(self) -> None:
        # KILLED: stopped before the last step (a STOP file or a signal, to be resumed)
        self.client.set_terminated(
            self.run_id, status="FINISHED" if self.last_step >= self.steps else "KILLED"
        )


class WandbTracker:
    """Metrics by run.log, each record's step as the metric WANDB_STEP (the charts' x axis), the
    per-expert counts as histograms; the plan as the run's config. Files under OUTPUT_DIR/wandb
    (offline: uploaded later with `wandb sync`)."""

    name = "W&B"

    def __init__(self, cfg: WandbSpec, plan: Plan, runs: RunIds):
        try:
            import wandb
        except ImportError as e:
            raise TrackerOff(
                f"the wandb package is not installed (pip install 'dskit[track]'): {e}"
            ) from None
        self.wandb = wandb
        if cfg.mode == "online":
            # no prompt (rank 0's terminal would wait for an answer) and no silent switch to offline,
            # which is what wandb.init does when it finds no API key
            if not wandb.login(prompt=False, verify=False):
                raise TrackerOff("no W&B API key: set WANDB_API_KEY in the trainer's environment")
        run_id = runs.get("wandb").get("id")
        if not isinstance(run_id, str):
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(12))
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=plan.name,
            id=run_id,
            resume="allow",
            mode=cfg.mode,
            dir=plan.run.output_dir,
            # console off: wandb would otherwise wrap rank 0's stdout and stderr to upload them
            settings=wandb.Settings(
                console="off",
                init_timeout=WANDB_INIT_TIMEOUT_S,
                # bounds wandb's own teardown at exit too; raises, so close() warns
                finish_timeout=WANDB_FINISH_TIMEOUT_S,
                finish_timeout_raises=True,
                silent=True,
            ),
        )
        self.run.define_metric(WANDB_STEP)
        self.run.define_metric("*", step_metric=WANDB_STEP)
        # after init, changes allowed: a resume at another world size updates the resumed run's config
        self.run.config.update(plan_params(plan), allow_val_change=True)
        runs.set("wandb", {"id": run_id})

    def write(self, rec: dict[str, Any]) -> None:
        data: dict[str, Any] = {WANDB_STEP: rec["step"], **tracker_metrics(rec)}
        for i, row in enumerate(rec.get(COUNTS) or []):
            # one bin per expert: tokens over expert index, as TensorBoard's histogram
            data[f"{COUNTS}/moe_layer_{i}"] = self.wandb.Histogram(
                np_histogram=(row, list(range(len(row) + 1)))
            )
        self.run.log(data)  # no step=: see WANDB_STEP

    def close(self) -> None:
        """run.finish(), waited for at most WANDB_FINISH_TIMEOUT_S: wandb's own limit covers its
        upload; this one, in a daemon thread, whatever else might block (the service process)."""
        failed: list[BaseException] = []

        def finish() -> None:
            try:
                self.run.finish()
            except BaseException as e:  # reported by the caller's thread
                failed.append(e)

        t = threading.Thread(target=finish, name="wandb-finish", daemon=True)
        t.start()
        t.join(WANDB_FINISH_TIMEOUT_S)
        if t.is_alive():
            raise TimeoutError(
                f"run.finish() did not return within {WANDB_FINISH_TIMEOUT_S} s; the process exits "
                "without it (`wandb sync OUTPUT_DIR/wandb/...` uploads what is left)"
            )
        if failed:
            raise failed[0]


class Trackers:
    """Every tracker the plan turns on (rank 0; other ranks get none). write() and close() never raise."""

    def __init__(self, plan: Plan, enabled: bool, resumed: bool = False):
        """`resumed`: the trainer starts from a checkpoint (step > 0), so the tracker runs of
        tracker-runs.json continue; otherwise new runs."""
        self.trackers: list[Tracker] = []
        if not enabled:
            return
        cfg = plan.tracking or TrackingSpec()
        if cfg.tensorboard:
            self.trackers.append(TensorBoardLog(plan.run.output_dir, enabled=True))  # warns on its own
        runs = RunIds(plan.run.output_dir, resumed)
        for kind, sub in ((MlflowTracker, cfg.mlflow), (WandbTracker, cfg.wandb)):
            if sub is None:
                continue
            t0 = time.perf_counter()
            try:
                self.trackers.append(kind(sub, plan, runs))
            except Exception as e:
                _off(kind.name, "cannot start", e)
            else:
                log.info("%s tracker on (%.1f s to start)", kind.name, time.perf_counter() - t0)

    def write(self, rec: dict[str, Any]) -> None:
        for t in list(self.trackers):
            try:
                t.write(rec)
            except Exception as e:
                # dropped unclosed: closing would ask the server that just failed (MLflow's status)
                self.trackers.remove(t)
                _off(t.name, f"failed at step {rec.get('step')}", e)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            try:
                t.close()
            except Exception as e:
                log.warning("%s tracker: closing failed: %s", t.name, reason(e))


def _off(name: str, what: str, e: BaseException) -> None:
    log.warning("%s tracker off (training goes on): %s: %s", name, what, reason(e))
