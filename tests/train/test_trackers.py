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
from dskit.train.trackers import RUNS_FILE, Trackers, param_text, plan_params, tracker_metrics  # noqa: E402
from tests.conftest import TINY_SETS, render_tiny  # noqa: E402
from tests.support.trackers import NO_TELEMETRY, MlflowServer, free_port, wandb_run  # noqa: E402

#: metrics.jsonl keys the trackers do not get as series: their axes, a restart marker, the per-expert
#: counts (a W&B histogram)
NOT_SERIES = {"step", "time", "resumed_from", "expert_counts"}


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
    """Every key of every record, at its step, in both; nothing else in MLflow."""
    keys: set[str] = set()
    for r in records:
        for k, v in expected(r).items():
            keys.add(k)
            assert mlflow[k][r["step"]] == pytest.approx(v, rel=1e-12), (k, r["step"])
            assert wandb[r["step"]][k] == pytest.approx(v, rel=1e-12), (k, r["step"])
    assert set(mlflow) == keys
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
    second = Trackers(plan, enabled=True)  # a requeued job's process
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


def test_a_tracker_that_cannot_start_warns_once_and_the_others_go_on(
    tmp_path, wandb_env, monkeypatch, caplog
):
    monkeypatch.setenv(
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"
    )  # refused at once (the trainer test: the default)
    closed = f"http://127.0.0.1:{free_port()}"
    plan = tiny_plan(tmp_path, f"tracking.mlflow.tracking_uri={closed}", "tracking.wandb.mode=online")
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
def test_a_run_whose_trackers_cannot_be_reached_warns_once_each_and_completes(tmp_path, wandb_env):
    closed = f"http://127.0.0.1:{free_port()}"
    rd = render_tiny(
        tmp_path,
        steps=2,
        name="unreached",
        extra=[f"tracking.mlflow.tracking_uri={closed}", "tracking.wandb.mode=online"],
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
