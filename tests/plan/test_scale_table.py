"""The plan at cluster scale (docs/planner.md's table, `bench/scale_table.py`): the table in the docs is
what the planner says today, and every pick in it renders.

Each pick is shrunk to CPU size (tiny-v2 on 2 nodes of 2 ranks: EP across nodes stays across nodes,
inside stays inside) with the same ZeRO stage, checkpointing and offload, and rendered; the trainer
runs each ZeRO stage (tests/train/test_zero_stages.py) and EP across nodes (tests/e2e/test_slurm.py). Optimizer
offload, which V2 and V3 picks use, is not run on CPU here (DeepSpeed's CPU Adam on the cpu
accelerator was never exercised by these tests).

The table is the bench script's, imported (`bench.scale_table.as_json`, what its `--json` prints).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scale_table
from dskit.plan.schema import load_plan
from tests.conftest import render_tiny
from tests.support.cli import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def table() -> dict:
    """The table as the planner gives it now (a fixture, not collection time: it plans ~90 configs):
    its rows, its markdown and the GPUs per node it assumes."""
    return json.loads(json.dumps(scale_table.as_json()))  # as `--json` prints it: tuples as lists


@pytest.fixture(scope="module")
def rows(table) -> list[dict]:
    return table["rows"]


def test_the_docs_table_is_todays_planner(table):
    assert table["markdown"] in (REPO / "docs" / "planner.md").read_text()


#: GPUs per node of the table's clusters (bench/scale_table.py PER_NODE; the table's JSON says it too)
PER_NODE = 8


def test_the_table_assumes_8_gpus_per_node(table):
    assert table["per_node"] == PER_NODE


def _shrunk(pick: dict) -> list[str]:
    ep = pick["ep_size"]
    shrunk_ep = 4 if ep > PER_NODE else 2 if ep > 1 else 1
    return [
        f"overrides.zero_stage={pick['zero_stage']}",
        f"overrides.ep_size={shrunk_ep}",
        f"overrides.activation_checkpointing={pick['activation_checkpointing']}",
        f"overrides.offload_optimizer={'cpu' if pick['offload_optimizer'] else 'none'}",
    ]


def _picks(rows: list[dict]) -> list[tuple[str, ...]]:
    return sorted({tuple(_shrunk(r["now"])) for r in rows if "refused" not in r["now"]})


def test_the_table_covers_the_new_choices(rows):
    stages = {p[0] for p in _picks(rows)}
    assert {"overrides.zero_stage=2", "overrides.zero_stage=3"} <= stages, _picks(rows)


def test_each_pick_shrunk_to_cpu_renders(rows, tmp_path):
    for i, sets in enumerate(_picks(rows)):
        rd = render_tiny(tmp_path / str(i), nodes=2, gpus_per_node=2, extra=list(sets))
        ds = json.loads((rd / "deepspeed.json").read_text())
        par = load_plan(rd / "run.yaml").parallel
        assert f"overrides.zero_stage={ds['zero_optimization']['stage']}" in sets
        assert f"overrides.ep_size={ds['expert_parallel']['autoep_size']}" in sets
        assert f"overrides.activation_checkpointing={par.activation_checkpointing}" in sets
        offloaded = "offload_optimizer" in ds["zero_optimization"]
        assert offloaded == ("overrides.offload_optimizer=cpu" in sets), sets


def test_refusals_in_the_table_are_one_line(rows):
    for r in rows:
        if "refused" in r["now"]:
            assert "\n" not in r["now"]["refused"] and "GiB" in r["now"]["refused"], r


def test_the_default_global_batch_scales_with_the_cluster():
    """512 GPUs: the default is 4 sequences per GPU (2048), not 256 (which no world of 512 divides)."""
    r = cli("plan", "--model", "deepseek-v3", "--gpus-per-node", "8", "--nodes", "64", "--gpu", "h100-80gb")
    assert r.returncode == 0, r.stderr
    assert "global_batch: 2048" in r.stdout
    bad = cli("plan", "--gpus-per-node", "8", "--nodes", "64", "--set", "training.global_batch=256")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "nearest: 512" in bad.stderr and "512, 512" not in bad.stderr, bad.stderr
