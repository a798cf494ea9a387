"""Pipeline parallelism on paper (`bench/pipeline_what_if.py`, docs/planner.md "Pipeline parallelism,
on paper"): the docs' table is what the planner's terms say today, and the composition behaves as its
docstring says (a stage is a shallower model trained by world / pp ranks, under a 1F1B bubble).
The what-if is the bench script's, imported (what its `--json LABEL` prints), and the measured rows
come through the manifest (tests/support/calibration.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from bench import pipeline_what_if
from tests.support import calibration

REPO = Path(__file__).resolve().parents[2]
V3_WIDTH = "h200-v3-width-2026-12-02.json"
#: how far the model's per-micro-step time may be from the one measured at V3's width
MICRO_STEP_TOLERANCE = 0.10

#: the docs table's rows: (label, gpu, spec overrides)
DOCS_ROWS = (
    ("256 x H100", "h100-80gb", []),
    ("256 x H200", "h200-141gb", []),
    ("256 x H100, global batch 4096", "h100-80gb", ["training.global_batch=4096"]),
)


@functools.cache
def what_if(gpu: str, sets: tuple[str, ...], label: str = "-") -> dict:
    """`bench/pipeline_what_if.py` for DeepSeek-V3 on 32 x 8 GPUs: its result, with `summary`, the
    docs table's row for it under `label`."""
    result = pipeline_what_if.as_json("deepseek-v3", gpu, 32, 8, list(sets), label)
    return json.loads(json.dumps(result))  # as `--json` prints it: tuples as lists


@pytest.fixture(scope="module")
def v3_h100() -> dict:
    return what_if("h100-80gb", ())


@pytest.mark.parametrize("label,gpu,sets", DOCS_ROWS)
def test_the_docs_table_is_todays_model(label, gpu, sets):
    row = what_if(gpu, tuple(sets), label)["summary"]
    assert row in (REPO / "docs" / "planner.md").read_text()


def test_a_layout_fits_only_under_the_gpu_limit(v3_h100):
    for r in v3_h100["rows"]:
        assert r["fits"] == (max(r["memory_gib"], r["construction_gib"]) <= v3_h100["limit_gib"] + 0.05), r


def test_the_bubble_is_1f1bs(v3_h100):
    for r in v3_h100["rows"]:
        assert r["bubble"] == pytest.approx((r["pp"] - 1) / (r["micro_batches"] + r["pp"] - 1), abs=1e-3)


def test_more_stages_hold_less_per_gpu(v3_h100):
    """At the same EP, micro-batch and checkpointing, a deeper pipeline holds fewer layers per GPU:
    less to build, whatever the in-flight micro-batches add to training memory."""
    by = {(r["ep"], r["micro_batch"], r["ckpt_every"], r["pp"]): r for r in v3_h100["rows"]}
    pairs = [(r, by.get((*k[:3], k[3] * 2))) for k, r in by.items()]
    pairs = [(a, b) for a, b in pairs if b is not None]
    assert pairs
    for shallow, deep in pairs:
        assert deep["construction_gib"] < shallow["construction_gib"], (shallow, deep)


def test_the_bound_is_never_slower_than_the_prediction(v3_h100):
    for r in v3_h100["rows"]:
        assert r["no_per_pass_cost_tokens_per_s_per_gpu"] >= r["tokens_per_s_per_gpu"], r


@pytest.mark.parametrize("stage", ["1", "2"])
def test_the_micro_step_the_verdict_rests_on_was_measured_at_v3s_width(stage):
    """The what-if's pipeline runs many micro-steps of one sequence; the H200 runs of 3 V3 layers with
    EP 8's 32 experts at accumulation 8 and 2 split a ZeRO-1/2 step into its per-micro-step part (the
    difference over 6 micro-steps) and its per-step part. Today's model must give the first within
    MICRO_STEP_TOLERANCE. (The per-step part it gives 5x low: bench/README.md "DeepSeek-V3's width".)"""
    rows = [r for r in calibration.rows("plan_bench.py", "v3-width") if r["_source"].endswith(V3_WIDTH)]
    runs = {
        r["config"]: r
        for r in rows
        if f"overrides.zero_stage={stage}" in r["overrides"] and "overrides.micro_batch=1" in r["overrides"]
    }
    long, short = runs["V3s L3 s4096 gb8"], runs["V3s L3 s4096 gb2"]
    measured = (long["measured"]["step_s"] - short["measured"]["step_s"]) / 6
    step = {
        k: calibration.predicted("plan_bench.py", r)["_predicted"]["step_s"]
        for k, r in (("long", long), ("short", short))
    }
    predicted = (step["long"] - step["short"]) / 6
    assert abs(predicted / measured - 1) <= MICRO_STEP_TOLERANCE, (predicted, measured)


@pytest.mark.parametrize(
    "name,gpu,sets",
    [
        ("model-pipeline-what-if-v3-h100-2026-12-02.json", "h100-80gb", []),
        ("model-pipeline-what-if-v3-h200-2026-12-02.json", "h200-141gb", []),
        (
            "model-pipeline-what-if-v3-h100-gb4096-2026-12-02.json",
            "h100-80gb",
            ["training.global_batch=4096"],
        ),
    ],
)
def test_the_committed_results_are_todays_script(name, gpu, sets):
    committed = json.loads(calibration.result(name).read_text())
    now = what_if(gpu, tuple(sets))
    assert committed["rows"] == now["rows"] and committed["today"] == now["today"]
