"""`dskit report` on synthetic metrics (fast): resumed runs, missing metrics, the page's contents.
The trainer's own metrics go through the report in tests/train/test_train.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dskit.plan.schema import load_plan
from dskit.status.report import read_metrics
from tests.conftest import render_tiny
from tests.support.cli import cli

PNG = b"\x89PNG\r\n\x1a\n"


def record(step: int, layers: int = 2, experts: int = 8, loss_shift: float = 0.0) -> dict:
    counts = [[100 + 40 * ((e + step + layer) % 3) for e in range(experts)] for layer in range(layers)]
    per_layer = [max(row) / (sum(row) / len(row)) for row in counts]
    return {
        "step": step,
        "loss": 5.0 * math.exp(-step / 10) + 1 + loss_shift,
        "aux_loss": 0.01 + 0.001 * step,
        "lr": 3e-3 * min(1.0, step / 5),
        "tokens_per_s_per_gpu": 1000.0 + step,
        "mfu": None,
        "peak_alloc_gib": 1.5,
        "peak_reserved_gib": 1.7,
        "step_time_s": 0.5,
        "time": 1.7e9 + step,
        "expert_load_max_over_mean": max(per_layer),
        "expert_load_per_layer": per_layer,
        "expert_counts": counts,
    }


def write_metrics(out: Path, recs: list[dict], torn: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in recs)
    if torn:
        text += '{"step": 99, "loss'  # a run killed mid-write
    (out / "metrics.jsonl").write_text(text)
    return out


def test_a_resumed_run_is_one_curve_with_its_restarts_marked(tmp_path):
    # steps 1..10, preempted, resumed from the step-6 checkpoint (7..10 logged again), then again at 15
    recs = [record(s) for s in range(1, 11)]
    recs += [record(s, loss_shift=0.5) for s in range(7, 16)]
    recs += [record(s, loss_shift=0.7) for s in range(13, 19)]
    recs += [{**record(19), "resumed_from": 18}, record(20)]  # a clean stop at 18: no step repeats
    s = read_metrics(write_metrics(tmp_path / "out", recs, torn=True) / "metrics.jsonl")
    assert [r["step"] for r in s.records] == list(range(1, 21))
    assert s.restarts == [7, 13, 19]
    assert s.records[7]["loss"] == pytest.approx(record(8, loss_shift=0.5)["loss"])  # the later one wins


def test_report_writes_pngs_and_one_self_contained_page(tmp_path):
    rd = render_tiny(tmp_path, "tiny-v2", steps=20)
    plan = load_plan(rd / "run.yaml")
    out_dir = Path(plan.run.output_dir)
    recs = [record(s) for s in range(1, 11)] + [record(s) for s in range(7, 21)]
    write_metrics(out_dir, recs)
    (out_dir / "launch-env.json").write_text(json.dumps({"DSKIT_GPU_PROFILE": "cpu", "MASTER_PORT": "29500"}))

    proc = cli("report", str(rd), "-o", str(tmp_path / "rep"), check=True)
    assert "index.html" in proc.stdout
    rep = tmp_path / "rep"
    for name in ("loss", "throughput", "memory", "expert_load", "lr"):
        assert (rep / f"{name}.png").read_bytes().startswith(PNG), name
    page = (rep / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 5
    assert 'src="http' not in page and "<script" not in page  # no external resources
    assert plan.summary().split(":")[0] in page  # the plan summary
    assert "DSKIT_GPU_PROFILE" in page and "29500" in page  # the launch contract
    assert "20 / 20" in page and ">7<" in page  # latest step of total; the restart


def test_the_computed_throughput_is_a_line_and_a_row_of_its_own(tmp_path):
    """Real tokens and what was computed (padding included) both show: on the plot the computed line is
    drawn over the real one in its own colour and dashes (with full rows the two are one curve, and a
    faint line beneath did not show), and on the page each figure has its own row."""
    from dskit.status.report import pyplot, throughput_figure

    full = [
        {**record(s), "real_tokens_per_s_per_gpu": 1000.0 + s, "packing_efficiency": 1.0} for s in range(1, 6)
    ]
    out = write_metrics(tmp_path / "out", full)
    fig = throughput_figure(read_metrics(out / "metrics.jsonl"))
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    pyplot().close(fig)
    real, computed = lines["real tokens"], lines["computed (with padding)"]
    assert list(computed.get_ydata()) == list(real.get_ydata())  # one curve: full rows
    assert computed.get_linestyle() == "--" and computed.get_color() != real.get_color()
    assert computed.get_zorder() > real.get_zorder()
    cli("report", str(out), check=True)
    page = (out / "report" / "index.html").read_text()
    assert "<tr><th>tokens/s/GPU, real tokens</th><td><code>1,005</code></td></tr>" in page
    assert "<tr><th>tokens/s/GPU computed, with padding</th><td><code>1,005 (rows 100% full)</code>" in page


def test_report_reads_a_bare_output_dir(tmp_path):
    out = write_metrics(tmp_path / "out", [record(s) for s in range(1, 4)])
    cli("report", str(out), check=True)
    assert (out / "report" / "index.html").is_file()
    assert (out / "report" / "memory.png").read_bytes().startswith(PNG)


@pytest.mark.parametrize("content", [None, "", "not json\n"])
def test_missing_or_empty_metrics_is_one_line_and_exit_2(tmp_path, content):
    rd = render_tiny(tmp_path, "tiny-v2", steps=5)
    if content is not None:
        out_dir = Path(load_plan(rd / "run.yaml").run.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "metrics.jsonl").write_text(content)
    proc = cli("report", str(rd))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("dskit: error:"), proc.stderr
    assert "metrics" in proc.stderr


def test_report_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    import sys

    from dskit.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'dskit[report]'" in err


# --------------------------------------------------------------------------- the real trainer


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """A short CPU run stopped through the STOP file after step 3, then resumed to the end: the
    metrics of a preempted and requeued job."""
    from dskit.launch.contract import EXIT_REQUEUE, STOP_FILE
    from tests.train.test_train import run, start, wait_for_step

    tmp = tmp_path_factory.mktemp("resumed")
    rd = render_tiny(tmp, "tiny-v2", steps=8, extra=["checkpoint.every=2"])
    plan = load_plan(rd / "run.yaml")
    p = start(rd, tmp / "a.log")
    try:
        wait_for_step(rd, p, 3)
        (Path(plan.run.checkpoint_dir) / STOP_FILE).touch()
        assert p.wait(timeout=300) == EXIT_REQUEUE, (tmp / "a.log").read_text()[-4000:]
    finally:
        p.kill()
    assert run(rd, tmp / "b.log") == 0, (tmp / "b.log").read_text()[-4000:]
    return rd


@pytest.mark.train
def test_report_on_a_stopped_and_resumed_cpu_run(resumed_run, tmp_path):
    out_dir = Path(load_plan(resumed_run / "run.yaml").run.output_dir)
    s = read_metrics(out_dir / "metrics.jsonl")
    assert [r["step"] for r in s.records] == list(range(1, 9))
    assert len(s.restarts) == 1 and s.records[s.restarts[0] - 1]["resumed_from"] == s.restarts[0] - 1
    cli("report", str(resumed_run), "-o", str(tmp_path / "rep"), check=True)
    page = (tmp_path / "rep" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 5 and "8 / 8" in page
    assert "DSKIT_RUN_FILE" in page  # the launch contract rank 0 recorded
    lines = [x for x in (resumed_run.parent / "b.log").read_text().splitlines() if " step " in x]
    assert lines and all(" eta " in x for x in lines if "loss" in x)  # no terminal: the log line has it


@pytest.mark.train
def test_cpu_run_writes_tensorboard_events_across_a_restart(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plan = load_plan(resumed_run / "run.yaml")
    tb = Path(plan.run.output_dir) / "tensorboard"
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2  # one file per process (segment)
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in ("train/loss", "train/aux_loss", "train/lr", "perf/tokens_per_s_per_gpu"):
        assert sorted({e.step for e in acc.Scalars(tag)}) == list(range(1, 9)), tag
    assert {"memory/peak_alloc_gib", "experts/max_over_mean/moe_layer_1"} <= set(tags["scalars"])
    last = acc.Histograms("experts/tokens_per_expert/moe_layer_0")[-1]
    want = [r for r in read_metrics(Path(plan.run.output_dir) / "metrics.jsonl").records if r["step"] == 8]
    assert last.step == 8 and list(last.histogram_value.bucket) == want[0]["expert_counts"][0]
