"""Pipeline parallelism on paper (`bench/pipeline_what_if.py`, docs/planner.md "Pipeline parallelism,
on paper"): the docs' table is what the planner's terms say today, and the composition behaves as its
docstring says (a stage is a shallower model trained by world / pp ranks, under a 1F1B bubble)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import bench_module

REPO = Path(__file__).resolve().parent.parent
WHAT_IF = bench_module("pipeline_what_if")

#: the docs table's rows: (label, gpu, spec overrides)
DOCS_ROWS = (
    ("256 x H100", "h100-80gb", []),
    ("256 x H200", "h200-141gb", []),
    ("256 x H100, global batch 4096", "h100-80gb", ["training.global_batch=4096"]),
)


@pytest.fixture(scope="module")
def v3_h100() -> dict:
    return WHAT_IF.what_if("deepseek-v3", "h100-80gb", 32, 8, [])


@pytest.mark.parametrize("label,gpu,sets", DOCS_ROWS)
def test_the_docs_table_is_todays_model(label, gpu, sets):
    row = WHAT_IF.summary(WHAT_IF.what_if("deepseek-v3", gpu, 32, 8, sets), label)
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
