"""MLflow and W&B beside metrics.jsonl (dskit/train/trackers.py), with the real libraries: a real
`mlflow server` on loopback started here (tests/support/trackers.py), W&B in offline mode with its run
file read back. The trackers on their own first (a restart continues the same runs; a tracker that
cannot start warns once), then the real 2-rank CPU trainer: every figure of metrics.jsonl reaches both,
and a run whose trackers are unreachable or lack credentials completes with one warning each."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from dskit.plan.build import build_plan  # noqa: E402
from dskit.plan.schema import Plan, load_plan  # noqa: E402
from dskit.spec import load_spec  # noqa: E402
from dskit.train.tensorboard import TB_DIR  # noqa: E402
from dskit.train.trackers import (  # noqa: E402
    RUNS_FILE,
    RunIds,
    Trackers,
    WandbTracker,
    param_text,
    plan_params,
    redact,
    tracker_metrics,
)
from tests.conftest import TINY_SETS, render_tiny  # noqa: E402
from tests.support.trackers import NO_TELEMETRY, MlflowServer, free_port, wandb_run  # noqa: E402

#: metrics.jsonl keys the trackers do not get as series: their axes, a restart marker, the per-expert
#: counts (a W&B histogram)
NOT_SERIES = {"step", "time", "resumed_from", "expert_counts"}
SENTINEL = "sentinelsecret"  # a password in MLFLOW_TRACKING_URI: must reach no file and no log line


def files_holding(d: Path, text: str) -> list[Path]:
    return [f for f in d.rglob("*") if f.is_file() and text.encode() in f.read_bytes()]


def expected(rec: dict[str, Any]) -> dict[str, float]:
    """What a tracker should hold for one metrics.jsonl record, written out here rather than taken from
    the module under test: every number, each per-MoE-layer list item as KEY/moe_layer_I."""
    out = {}
    for k, v in rec.items():
        if k in NOT_SERIES or v is None:
            continue
        if isinstance(v, list):
            out.update({f"{k}/moe_layer_{i}": float(x) for i, x in enumerate(v)})
        else:
            out[k] = float(v)
    return out


def rec(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "loss": 5.0 - step,
        "aux_loss": 0.01,
        "lr": 1e-3,
        "real_tokens_per_s_per_gpu": 100.5,
        "mfu": None,
        "peak_alloc_gib": 1.0,
        "time": 1.8e9 + step,
        "expert_load_max_over_mean": 1.5,
        "expert_load_per_layer": [1.5, 1.25],
        "expert_counts": [[30, 10, 10, 10], [25, 15, 10, 10]],
    }


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    print(f"mlflow server ready in {server.started_s:.1f} s")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def no_telemetry(monkeypatch):
    for var, value in NO_TELEMETRY.items():
        monkeypatch.setenv(var, value)


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B's own files and credentials in tmp_path: no API key, no netrc, no settings from $HOME."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def tiny_plan(tmp: Path, *sets: str) -> Plan:
    flags = {"hardware.gpu": "cpu", "hardware.gpus_per_node": 2, "model.preset": "tiny-v2", "name": "trk"}
    return build_plan(load_spec(sets=[*TINY_SETS, f"storage.root={tmp}", *sets], flags=flags))


def mlflow_series(url: str, run_id: str) -> tuple[Any, dict[str, dict[int, float]]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=url)
    run = client.get_run(run_id)
    series = {k: {m.step: m.value for m in client.get_metric_history(run_id, k)} for k in run.data.metrics}
    return run, series


def check_series(records: list[dict], mlflow: dict[str, dict[int, float]], wandb: dict[int, dict]) -> None:
    """Every key of every record, at its step, in both; nothing else in MLflow, no other step in W&B."""
    keys: set[str] = set()
    for r in records:
        for k, v in expected(r).items():
            keys.add(k)
            assert mlflow[k][r["step"]] == pytest.approx(v, rel=1e-12), (k, r["step"])
            assert wandb[r["step"]][k] == pytest.approx(v, rel=1e-12), (k, r["step"])
    assert set(mlflow) == keys
    assert set(wandb) == {r["step"] for r in records}
    for r in records:
        for i, row in enumerate(r.get("expert_counts") or []):
            assert wandb[r["step"]][f"expert_counts/moe_layer_{i}/values"] == row


# --------------------------------------------------------------------------- the trackers on their own


def test_tracker_metrics_are_the_records_numbers():
    r = rec(2)
    assert tracker_metrics(r) == expected(r)
    assert "mfu" not in tracker_metrics(r)  # no peak FLOP/s: nothing made up
    assert tracker_metrics({"step": 2, "eval_loss": 3.5, "eval_tokens": 512, "time": 1.0}) == {
        "eval_loss": 3.5,
        "eval_tokens": 512.0,
    }


@pytest.mark.slow
def test_both_trackers_get_every_record_and_a_restart_continues_their_runs(
    mlflow_server, tmp_path, wandb_env
):
    plan = tiny_plan(
        tmp_path,
        "training.steps=3",
        f"tracking.mlflow.tracking_uri={mlflow_server.url}",
        "tracking.mlflow.experiment=unit",
        "tracking.wandb.mode=offline",
    )
    out = Path(plan.run.output_dir)
    assert not Trackers(plan, enabled=False).trackers and not out.exists()  # ranks other than 0
    first = Trackers(plan, enabled=True)
    assert [t.name for t in first.trackers] == ["TensorBoard", "MLflow", "W&B"]
    evals = {"step": 2, "eval_loss": 3.25, "eval_tokens": 512, "time": 1.8e9 + 2.5}
    for r in (rec(1), rec(2), evals):
        first.write(r)
    first.close()
    ids = json.loads((out / RUNS_FILE).read_text())
    second = Trackers(plan, enabled=True, resumed=True)  # a requeued job's process, from a checkpoint
    second.write(rec(3))
    second.close()
    assert json.loads((out / RUNS_FILE).read_text()) == ids

    run, series = mlflow_series(mlflow_server.url, ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "trk"
    assert run.data.params == {k: param_text(v) for k, v in plan_params(plan).items()}
    assert run.data.params["parallel.ep_size"] == "2" and run.data.params["hardware.world_size"] == "2"
    config, history = wandb_run(out)
    assert {p.name.rsplit("-", 1)[1] for p in (out / "wandb").glob("offline-run-*")} == {ids["wandb"]["id"]}
    assert config["parallel.ep_size"] == 2 and config["name"] == "trk"
    check_series([rec(1), rec(2), evals, rec(3)], series, history)


@pytest.mark.slow
def test_a_tracker_failing_mid_run_warns_once_and_the_others_go_on(
    mlflow_server, tmp_path, wandb_env, caplog
):
    from mlflow import MlflowClient

    plan = tiny_plan(
        tmp_path, f"tracking.mlflow.tracking_uri={mlflow_server.url}", "tracking.wandb.mode=offline"
    )
    out = Path(plan.run.output_dir)
    with caplog.at_level(logging.WARNING):
        trackers = Trackers(plan, enabled=True)
        trackers.write(rec(1))
        run_id = json.loads((out / RUNS_FILE).read_text())["mlflow"]["run_id"]
        MlflowClient(tracking_uri=mlflow_server.url).delete_run(run_id)  # the server now refuses its metrics
        for s in (2, 3):
            trackers.write(rec(s))
        trackers.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith(
        "MLflow tracker off (training goes on): failed at step 2: RestException: INVALID_PARAMETER_VALUE: "
    ), warnings
    _, history = wandb_run(out)
    assert sorted(s for s in history if "loss" in history[s]) == [1, 2, 3]


def test_redact_removes_any_userinfo():
    assert redact("API request to https://u:p@h:5000/api failed; http://tok@h2/x ok") == (
        "API request to https://***@h:5000/api failed; http://***@h2/x ok"
    )
    assert redact("http://h:5000/a@b user@example.org") == "http://h:5000/a@b user@example.org"


@pytest.mark.slow
def test_a_uri_credential_is_never_stored_and_a_fresh_start_begins_new_runs(
    mlflow_server, tmp_path, wandb_env, monkeypatch, caplog
):
    # the environment's URI is not checked as the spec's is: user:password@ reaches the tracker
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url.replace("//", f"//user:{SENTINEL}@"))
    plan = tiny_plan(
        tmp_path, "tracking.mlflow={}", "tracking.wandb.mode=offline", "tracking.tensorboard=false"
    )
    out = Path(plan.run.output_dir)

    def one(resumed: bool, step: int) -> dict:
        trackers = Trackers(plan, enabled=True, resumed=resumed)
        assert [t.name for t in trackers.trackers] == ["MLflow", "W&B"]
        trackers.write(rec(step))
        trackers.close()
        return json.loads((out / RUNS_FILE).read_text())

    with caplog.at_level(logging.INFO):
        first = one(False, 1)
        assert one(True, 2) == first  # resumed from a checkpoint: the same runs
        fresh = one(False, 1)  # an empty checkpoint dir, the same output dir: new runs
    assert fresh["mlflow"]["run_id"] != first["mlflow"]["run_id"]
    assert fresh["wandb"]["id"] != first["wandb"]["id"]
    assert fresh["mlflow"]["tracking_uri"] == mlflow_server.url
    assert not files_holding(out, SENTINEL)
    assert not [r.getMessage() for r in caplog.records if SENTINEL in r.getMessage()]


def test_wandb_keeps_a_step_below_one_already_logged(tmp_path, wandb_env):
    """A resume from a checkpoint older than the last logged step logs steps again. An online resumed
    run continues W&B's own step from its last one (offline has no server to ask): the same state as
    one process logging step 20, then 10."""
    plan = tiny_plan(tmp_path, "tracking.wandb.mode=offline")
    tracker = WandbTracker(plan.tracking.wandb, plan, RunIds(plan.run.output_dir, resumed=False))
    for s in (20, 10):
        tracker.write(rec(s))
    tracker.close()
    _, history = wandb_run(Path(plan.run.output_dir))
    assert sorted(history) == [10, 20]
    assert history[10]["loss"] == rec(10)["loss"] and history[20]["loss"] == rec(20)["loss"]


def test_a_wandb_finish_that_does_not_return_is_left_behind_with_one_warning(
    tmp_path, wandb_env, monkeypatch, caplog
):
    """run.finish() against a server gone away may block past a pod's grace period: close() waits at
    most WANDB_FINISH_TIMEOUT_S. The block is made here (no W&B server to take away), the run real."""
    import threading

    from dskit.train import trackers as mod

    monkeypatch.setattr(mod, "WANDB_FINISH_TIMEOUT_S", 0.5)
    plan = tiny_plan(tmp_path, "tracking.wandb.mode=offline", "tracking.tensorboard=false")
    trackers = Trackers(plan, enabled=True)
    wandb_tracker = trackers.trackers[0]
    real_finish, release = wandb_tracker.run.finish, threading.Event()
    monkeypatch.setattr(wandb_tracker.run, "finish", lambda: (release.wait(60), real_finish()))
    trackers.write(rec(1))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        trackers.close()
    waited = time.monotonic() - t0
    release.set()  # the real finish, in the left-behind thread: done before the next test's wandb.init
    for t in threading.enumerate():
        if t.name == "wandb-finish":
            t.join(60)
    warnings = [r.getMessage() for r in caplog.records if r.name == "dskit.train"]
    assert len(warnings) == 1 and warnings[0].startswith(
        "W&B tracker: closing failed: TimeoutError: run.finish() did not return within 0.5 s"
    ), warnings
    assert 0.5 <= waited < 5


def test_a_tracker_that_cannot_start_warns_once_and_the_others_go_on(
    tmp_path, wandb_env, monkeypatch, caplog
):
    monkeypatch.setenv(
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"
    )  # refused at once (the trainer test: the default)
    # from the environment, with a credential MLflow's error text would repeat
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:{SENTINEL}@127.0.0.1:{free_port()}")
    plan = tiny_plan(tmp_path, "tracking.mlflow={}", "tracking.wandb.mode=online")
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO):
        trackers = Trackers(plan, enabled=True)
        for s in (1, 2):
            trackers.write(rec(s))
        trackers.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("MLflow tracker off (training goes on): cannot start: MlflowException: ")
    assert "Connection refused" in warnings[0] and "\n" not in warnings[0]
    assert SENTINEL not in warnings[0] and "//***@127.0.0.1:" in warnings[0], warnings[0]
    assert warnings[1] == (
        "W&B tracker off (training goes on): cannot start: no W&B API key: set WANDB_API_KEY in the "
        "trainer's environment"
    )
    assert [t.name for t in trackers.trackers] == []  # closed
    assert list((Path(plan.run.output_dir) / TB_DIR).glob("events.out.tfevents.*"))  # TensorBoard wrote
    assert not (Path(plan.run.output_dir) / "wandb").exists()
    assert time.monotonic() - t0 < 30


# --------------------------------------------------------------------------- the real trainer


def run_trainer(rd: Path, log: Path) -> int:
    from tests.train.test_train import run

    t0 = time.monotonic()
    rc = run(rd, log)
    print(f"{rd.name}: trained in {time.monotonic() - t0:.1f} s")
    return rc


def read_records(rd: Path) -> tuple[Path, list[dict]]:
    out = Path(load_plan(rd / "run.yaml").run.output_dir)
    return out, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.train
def test_a_2_rank_cpu_run_logs_every_metric_to_mlflow_and_wandb(mlflow_server, tmp_path, wandb_env):
    rd = render_tiny(
        tmp_path,
        steps=3,
        name="tracked",
        extra=[f"tracking.mlflow.tracking_uri={mlflow_server.url}", "tracking.wandb.mode=offline"],
    )
    assert run_trainer(rd, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-4000:]
    log = (tmp_path / "train.log").read_text()
    assert "tracker off" not in log and "Retrying" not in log, log[-4000:]
    out, records = read_records(rd)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["expert_counts"] for r in records)
    ids = json.loads((out / RUNS_FILE).read_text())
    run, series = mlflow_series(mlflow_server.url, ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert {
        "loss",
        "real_tokens_per_s_per_gpu",
        "peak_alloc_gib",
        "expert_load_per_layer/moe_layer_1",
    } <= set(series)
    plan = load_plan(rd / "run.yaml")
    assert run.data.params == {k: param_text(v) for k, v in plan_params(plan).items()}
    config, history = wandb_run(out)
    assert config["hardware.world_size"] == 2 and config["model.name"] == plan.model.name
    check_series(records, series, history)


@pytest.mark.train
def test_a_run_whose_trackers_cannot_be_reached_warns_once_each_and_completes(
    tmp_path, wandb_env, monkeypatch
):
    # the server from the trainer's environment, with a credential that must reach no log and no file
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:{SENTINEL}@127.0.0.1:{free_port()}")
    # MLflow's client still retries (dskit's count), without its seconds of backoff between the tries
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
    rd = render_tiny(
        tmp_path, steps=2, name="unreached", extra=["tracking.mlflow={}", "tracking.wandb.mode=online"]
    )
    assert run_trainer(rd, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()[-4000:]
    log = (tmp_path / "train.log").read_text()
    warnings = [x for x in log.splitlines() if "WARNING" in x and ("tracker" in x or "mlflow" in x.lower())]
    assert len(warnings) == 2 and "Retrying" not in log, warnings  # urllib3's retries stay quiet
    assert "MLflow tracker off (training goes on): cannot start: " in warnings[0]
    assert "W&B tracker off (training goes on): cannot start: no W&B API key" in warnings[1]
    out, records = read_records(rd)
    assert [r["step"] for r in records] == [1, 2]
    assert list((out / TB_DIR).glob("events.out.tfevents.*"))
    assert not (out / RUNS_FILE).exists() and os.listdir(out)
    assert not files_holding(tmp_path, SENTINEL) and not files_holding(out, SENTINEL)
