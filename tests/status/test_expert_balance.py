"""The expert balance as `dskit report` and `dskit status` show it, from one function (fast, synthetic
metrics): the worst layer's max/mean load and the routing bias's spread, a heatmap of each over steps.
The trainer's own records go through it in tests/train/test_aux_free.py."""

from __future__ import annotations

from pathlib import Path

from dskit.plan.schema import load_plan
from dskit.status.report import balance_text
from dskit.status.run_status import progress_rows
from tests.conftest import render_tiny
from tests.status.test_report import PNG, record, write_metrics
from tests.support.cli import cli


def with_bias(step: int) -> dict:
    spread = [0.05 + 0.001 * step, 0.05 + 0.002 * step]
    return {**record(step), "expert_bias_spread_per_layer": spread, "expert_bias_spread": max(spread)}


def test_the_balance_reads_the_same_in_the_report_and_in_status(tmp_path):
    rd = render_tiny(tmp_path, "tiny-v3", steps=20, extra=["training.seq_len=128"])
    out = Path(load_plan(rd / "run.yaml").run.output_dir)
    recs = [with_bias(s) for s in range(1, 21)]
    write_metrics(out, recs)
    text = balance_text(recs[-1])
    assert text == (
        f"max/mean load {recs[-1]['expert_load_max_over_mean']:.2f} (worst of 2 MoE layers; 1 = balanced), "
        "routing-bias spread 0.09 (max - min, widest layer)"
    )
    rows = dict(progress_rows(load_plan(rd / "run.yaml"), rd, running=None))
    assert rows["expert balance"] == text
    cli("report", str(rd), "-o", str(tmp_path / "rep"), check=True)
    page = (tmp_path / "rep" / "index.html").read_text()
    assert text in page
    assert "balance aux_free: tiny-v3 routes with a per-expert bias" in page  # the plan's choice, and why
    assert "routing-bias spread heatmaps" in page
    assert (tmp_path / "rep" / "expert_load.png").read_bytes().startswith(PNG)


def test_a_model_without_the_bias_shows_the_load_alone():
    assert balance_text(record(3)).endswith("(worst of 2 MoE layers; 1 = balanced)")
    assert balance_text({"step": 1, "loss": 2.0}) is None  # records from before the load was logged
