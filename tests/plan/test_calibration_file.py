"""The calibration file as the plan reads it (dskit/calibrate/calibration.py): used where it matches the plan's
hardware, refused in one line (exit 2, nothing written) where it does not, is damaged, or is not one.

The files here are written by the test, not measured: they test the reader and the model's use of
rates. The measuring job runs in tests/train/test_calibrate_local.py and on the Slurm cluster
(tests/e2e/test_calibrate_cluster.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dskit.calibrate import calibration
from dskit.plan import links as links_mod
from dskit.plan.build import build_plan_searched
from dskit.plan.links import Group, Links
from dskit.spec import load_spec
from tests.support.cli import cli

TWO_NODES = ["hardware.nodes=2", "hardware.gpu=h100-80gb", "training.global_batch=256"]


def _file(tmp: Path, *, cross_node_gbs: float, gpu: str = "h100-80gb", **over) -> Path:
    """A calibration of 2 nodes of 8 H100 whose groups across nodes measured `cross_node_gbs`."""

    def fit(gbs: float) -> dict:
        return {"bus_gbs": gbs, "latency_s": 5e-5, "points": [[2**20, 5e-5 + 2**20 / gbs / 1e9]]}

    shapes = {"8x1": fit(400.0), "1x2": fit(cross_node_gbs), "2x2": fit(cross_node_gbs * 2)}
    for r in (4, 8):
        shapes[f"{r}x2"] = fit(min(400.0, r * cross_node_gbs))
    data = {
        "version": calibration.VERSION,
        "dskit": "test",
        "created": "2026-12-04T00:00:00+00:00",
        "hardware": {
            "gpu": gpu,
            "fabric": "infiniband",
            "nodes": 2,
            "procs_per_node": 8,
            "device": "test",
            "backend": "nccl",
            "torch": "test",
            "nccl": None,
            "driver": None,
        },
        "collectives": {op: dict(shapes) for op in calibration.OPS},
        **over,
    }
    p = tmp / "calibration.json"
    p.write_text(json.dumps(data))
    return p


def _plan(*sets: str):
    return build_plan_searched(load_spec(None, [*TWO_NODES, *sets], {}))


def test_measured_rates_replace_the_catalogs(tmp_path):
    """Each group shape takes its measured rate; the plan says where each term's rate came from."""
    cal = calibration.load(
        _file(tmp_path, cross_node_gbs=5.0), field="f", gpu="h100-80gb", fabric="infiniband", procs_per_node=8
    )
    links = Links(450, 48, cal, "nvlink")
    assert links.rate("all_gather", Group(1, 2)).bus_gbs == 5.0
    assert links.rate("all_gather", Group(8, 1)).latency_s == 5e-5  # measured inside a node too
    # a ring over more nodes than calibrated: the widest measured ring's bandwidth; its latency scaled by
    # NCCL's ring model from 8 x 2 to 8 x 4 ranks: 14 -> 28 steps inside nodes, 1 -> 3 across them
    wide = links.rate("all_gather", Group(8, 4))
    model = {n: 8.4 + (8 * n - 1 - (n - 1)) * 3.4 + (n - 1) * 9.6 for n in (2, 4)}
    assert wide.bus_gbs == 40.0 and wide.latency_s == pytest.approx(5e-5 * model[4] / model[2])
    plan, found = _plan(f"hardware.calibration={tmp_path / 'calibration.json'}")
    sources = found.chosen.speed.as_dict()["sources"]
    groups = [k for k in sources if k.endswith(" nodes)")]  # the groups across the two nodes
    assert groups and all(sources[k].startswith(links_mod.MEASURED) for k in groups)
    assert all(
        v.startswith(links_mod.CATALOG)
        for k, v in _plan()[1].chosen.speed.as_dict()["sources"].items()
        if "group" in k
    )


def test_a_slow_fabric_moves_the_pick_to_less_cross_node_traffic(tmp_path):
    """A fabric measured at a tenth of its catalog rate makes every candidate's traffic across nodes
    dearer: the pick's predicted collective time across nodes falls below the catalog pick's, or the
    pick keeps its configuration and pays for it in predicted speed."""
    base, _ = _plan()
    slow, found = _plan(f"hardware.calibration={_file(tmp_path, cross_node_gbs=5.0)}")
    assert slow.speed["tokens_per_s_per_gpu"] < base.speed["tokens_per_s_per_gpu"]
    same = (slow.parallel.zero_stage, slow.parallel.ep_size) == (
        base.parallel.zero_stage,
        base.parallel.ep_size,
    )
    moved = not same and slow.speed["collectives_s"] + slow.speed.get("boundary_s", 0) < _collectives_of(
        found, base
    )
    assert moved or same
    assert not same, "a 10x slower fabric should change the pick for V2-Lite on 2 x 8 H100"


def _collectives_of(found, plan) -> float:
    """The calibrated prediction of the catalog pick's configuration."""
    p = plan.parallel
    for r in found.rows:
        c = r.candidate
        if (c.zero_stage, c.ep_size, c.micro_batch, c.ckpt_every, c.offload) == (
            p.zero_stage,
            p.ep_size,
            p.micro_batch,
            p.activation_checkpointing,
            p.offload_optimizer,
        ):
            return r.speed.collectives_s + r.speed.boundary_s
    raise AssertionError("the catalog pick is not among the calibrated candidates")


@pytest.mark.parametrize(
    "damage,says",
    [
        (lambda p: p.unlink(), "does not exist (run `dskit calibrate` first)"),
        (lambda p: p.write_text("{not json"), "is damaged (not JSON"),
        (lambda p: p.write_text('{"version": 99}'), "calibration version 99, this dskit reads 2"),
        (
            lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "collectives": 3})),
            "is damaged at collectives",
        ),
        (lambda p: p.write_text("[" * 100_000), "is damaged"),
        (
            lambda p: p.write_bytes(b" " * (calibration.MAX_BYTES + 1)),
            "over the 4,194,304 a calibration can be",
        ),
        (lambda p: p.write_bytes(b"\xff\xfe"), "cannot read"),
    ],
    ids=["missing", "not-json", "version", "bad-field", "deep", "huge", "binary"],
)
def test_a_damaged_calibration_is_refused_in_one_line(tmp_path, damage, says):
    p = _file(tmp_path, cross_node_gbs=50.0)
    damage(p)
    assert says in refusal(tmp_path, p)


def refusal(tmp: Path, cal: Path) -> str:
    """`dskit render slurm --calibration CAL` of the two-node plan, refused: its one line, having written
    nothing."""
    out = tmp / "run"
    r = cli("render", "slurm", "-o", str(out), "--calibration", str(cal), *(f"--set={s}" for s in TWO_NODES))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and not out.exists() and len(lines) == 1, r.stderr
    assert lines[0].startswith("dskit: error: hardware.calibration:"), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "sets,says",
    [
        (["hardware.gpu=h200-141gb"], "measured with gpu 'h100-80gb', this plan has 'h200-141gb'"),
        (["network.fabric=roce"], "measured with fabric 'infiniband', this plan has 'roce'"),
        (["hardware.gpus_per_node=4"], "measured with procs_per_node 8, this plan has 4"),
    ],
)
def test_a_calibration_of_other_hardware_is_refused(tmp_path, sets, says):
    p = _file(tmp_path, cross_node_gbs=50.0)
    r = cli("plan", "--calibration", str(p), *(f"--set={s}" for s in [*TWO_NODES, *sets]), check=False)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _with_probes(p: Path, *, gemm_share: float, host: float) -> Path:
    """`p` with GEMM and host probe readings: `gemm_share` of the reference's share of peak, `host` x
    its host time."""
    from dskit.calibrate.scales import reference

    ref = reference().compute
    data = json.loads(p.read_text())
    data["compute"] = {
        "gemm_tflops": ref.gemm_tflops * gemm_share,  # h100 and h200 have the same bf16 peak
        "attention_tflops": None,
        "host_layer_pass_s": ref.host_layer_pass_s * host,
    }
    p.write_text(json.dumps(data))
    return p


def test_probes_scale_the_fitted_terms_by_the_whole_ratio_however_near_one(tmp_path):
    """A GEMM probe at half the reference's share of peak doubles the compute term; a host probe 10%
    slower than the reference's makes the host term 10% longer (no band inside which a reading counts
    as the reference's), and the plan says so."""
    from dskit.calibrate.scales import SCALED, factors

    def load(p: Path):
        return calibration.load(p, field="f", gpu="h100-80gb", fabric="infiniband", procs_per_node=8)

    near = factors(load(_with_probes(_file(tmp_path, cross_node_gbs=50), gemm_share=0.5, host=1.1)))
    assert near.compute == pytest.approx(2.0) and near.sources["compute"].startswith(SCALED)
    assert near.host == pytest.approx(1.1) and near.sources["host"] == f"{SCALED} (x1.10)"
    slow = factors(load(_with_probes(_file(tmp_path, cross_node_gbs=50), gemm_share=1.0, host=3.0)))
    assert slow.compute == 1.0 and slow.host == pytest.approx(3.0)
    base, _ = _plan()
    p = _with_probes(_file(tmp_path, cross_node_gbs=50), gemm_share=0.5, host=1.0)
    halved, _ = _plan(f"hardware.calibration={p}")
    assert halved.speed["compute_s"] > 1.5 * base.speed["compute_s"]
