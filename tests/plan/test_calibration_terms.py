"""Every term the plan takes from a calibration is used, and used once.

A calibration (dskit/calibrate/calibration.py) gives the plan a rate per collective and group shape,
AutoEP's measured exchange, and four probes (GEMM, attention, host, CPU Adam) that scale the fitted
terms against a reference machine (dskit/calibrate/scales.py); dskit/plan/links.py and
dskit/plan/speed.py turn them into seconds. Each test here moves one measurement and checks that the
predicted term moves by exactly what the model's arithmetic says: a term that ignored its measurement
would not move, one that applied it twice would move by its square. The expected values are written out
from the rules in the docstrings, not by calling the function under test again.

With the tests beside them that read a calibration, these are what bench/mutation.py runs against each
mutant of that code (docs/development.md "Mutation testing of the plan's calibration use"): several cases
here (a GPU of another peak, a ring extrapolated both ways, a tie between two rings, a 300-character
echo) are there because a mutant behaved as the original without them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dskit import catalog
from dskit.calibrate import calibration
from dskit.calibrate.calibration import EXCHANGE, Calibration
from dskit.calibrate.scales import FITTED, SCALED, TERMS, factors, fitted, kind_of, reference, scaled
from dskit.errors import SpecError
from dskit.plan import adapters, speed
from dskit.plan.candidate import Candidate, Cluster, Fp8Compute, Workload
from dskit.plan.links import A2A_LINK_SHARE, CATALOG, GB, MEASURED, Group, Links, Rate
from dskit.plan.links import groups as shapes_of
from dskit.plan.model_math import counts, flops_per_token
from dskit.plan.shape import ModelShape
from tests.plan.test_calibration_file import _file, _plan, _with_probes

H100, H200, A100, L40S, CPU = (
    catalog.gpu(n) for n in ("h100-80gb", "h200-141gb", "a100-80gb", "l40s-48gb", "cpu")
)
IB, TCP = catalog.fabric("infiniband"), catalog.fabric("tcp")
#: tight enough to tell 1e12 from 1e12 + 1 (a mutant's constant), loose enough for summation order
REL = 1e-13
AG, RS = "all_gather", "reduce_scatter"


def approx(x: float):
    return pytest.approx(x, rel=REL, abs=1e-300)


def _fit(gbs: float, latency_s: float) -> dict:
    return {"bus_gbs": gbs, "latency_s": latency_s, "points": []}


def _data(
    collectives: dict[str, dict[str, tuple[float, float]]] | None = None,
    *,
    gpu: str = "h100-80gb",
    fabric: str = "infiniband",
    nodes: int = 2,
    per_node: int = 8,
    compute: dict | None = None,
    cpu_adam: float | None = None,
    **over,
) -> dict:
    """A calibration file's contents: `collectives` op -> shape -> (bus GB/s, latency s), the probes'
    readings (`compute`: Compute's fields; `cpu_adam`: core-seconds per billion parameters)."""
    return {
        "version": calibration.VERSION,
        "dskit": "test",
        "created": "2026-12-05T00:00:00+00:00",
        "hardware": {
            "gpu": gpu,
            "fabric": fabric,
            "nodes": nodes,
            "procs_per_node": per_node,
            "device": "test",
            "backend": "nccl",
            "torch": "test",
            "nccl": None,
            "driver": None,
        },
        "collectives": {
            op: {key: _fit(*v) for key, v in shapes.items()} for op, shapes in (collectives or {}).items()
        },
        "compute": compute or {},
        "cpu_adam": None
        if cpu_adam is None
        else {"core_s_per_bparam": cpu_adam, "ranks": per_node, "threads_per_rank": 1},
        **over,
    }


def _cal(*args, **kw) -> Calibration:
    return Calibration.model_validate(_data(*args, **kw))


def _write(tmp: Path, data: dict | str | bytes, name: str = "calibration.json") -> Path:
    p = tmp / name
    if isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def _refusal(p: Path, field: str = "f") -> str:
    with pytest.raises(SpecError) as e:
        calibration.read(p, field=field)
    assert e.value.field == field
    return e.value.message


# ---------------------------------------------------------------------------------------------------
# The reader: a file is used whole or refused in one line naming what is wrong


def test_a_valid_file_is_read_whole(tmp_path):
    """Every field comes back as written; shapes of as many nodes as the job had, up to every rank of
    a node, are group shapes (a 1 x 16 ring on nodes of 8 is one)."""
    data = _data(
        {AG: {"8x1": (400.0, 1e-5), "1x16": (40.0, 2e-5)}, EXCHANGE: {"8x2": (90.0, 3e-4)}},
        compute={"gemm_tflops": 600.0, "attention_tflops": 300.0, "host_layer_pass_s": 2e-4},
        cpu_adam=3.0,
        warnings=["slow"],
    )
    cal = calibration.read(_write(tmp_path, data))
    assert cal == Calibration.model_validate(data)
    assert cal.collectives[AG]["1x16"].bus_gbs == 40.0 and cal.collectives[EXCHANGE]["8x2"].latency_s == 3e-4
    assert cal.compute.gemm_tflops == 600.0 and cal.cpu_adam.core_s_per_bparam == 3.0


def test_the_reader_names_its_field_calibration_unless_told(tmp_path):
    with pytest.raises(SpecError) as e:
        calibration.read(tmp_path / "none.json")
    assert e.value.field == "calibration"


def test_a_missing_file_a_directory_or_an_unreadable_one_is_refused(tmp_path):
    missing = tmp_path / "none.json"
    assert _refusal(missing) == f"{missing} does not exist (run `dskit calibrate` first)"
    assert (
        _refusal(tmp_path) == f"{tmp_path} is not a file (give the calibration.json `dskit calibrate` wrote)"
    )
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)  # an OSError of its own: its strerror is said, not Python's repr of it
    assert _refusal(loop) == f"cannot read {loop}: Too many levels of symbolic links"
    binary = _write(tmp_path, b"\xff\xfe")
    assert _refusal(binary) == (
        f"cannot read {binary}: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"
    )


def test_a_file_over_the_limit_is_refused_before_it_is_parsed(tmp_path):
    huge = _write(tmp_path, b" " * (calibration.MAX_BYTES + 1))
    assert _refusal(huge) == f"{huge} is 4,194,305 bytes, over the 4,194,304 a calibration can be"
    at_limit = _write(tmp_path, b" " * (calibration.MAX_BYTES - 2) + b"{}")
    assert "version None" in _refusal(at_limit)  # read and parsed: refused for what it holds


def test_damaged_json_is_refused_with_the_parsers_words_cut(tmp_path):
    deep = _write(tmp_path, "[" * 40 + "]" * 40)
    assert _refusal(deep) == f"{deep} is damaged (nests deeper than 32 levels)"
    digits = _write(tmp_path, "1" * 5000)  # the parser's message is longer than the 80 characters kept
    said = "Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits; use "
    assert _refusal(digits) == f"{digits} is damaged (not JSON: {said[:80]})"


@pytest.mark.parametrize(
    "version,got",
    [(99, "99"), (2.0, "2.0"), ("2", "'2'"), (True, "True"), (None, "None")],
    ids=["other", "float", "string", "bool", "missing"],
)
def test_a_file_of_another_version_is_refused(tmp_path, version, got):
    """Only the integer VERSION is this reader's: 2.0 or "2" would pass a looser check."""
    data = _data()
    data["version"] = version
    p = _write(tmp_path, data)
    assert _refusal(p) == f"{p}: calibration version {got}, this dskit reads 2; re-run calibrate"


def test_json_that_is_not_an_object_is_refused_by_its_type(tmp_path):
    p = _write(tmp_path, "[]")
    assert _refusal(p) == f"{p}: calibration version 'list', this dskit reads 2; re-run calibrate"


def test_a_field_out_of_range_is_refused_at_its_path(tmp_path):
    data = _data()
    data["hardware"]["nodes"] = 0
    p = _write(tmp_path, data)
    assert _refusal(p) == f"{p} is damaged at hardware.nodes: Input should be greater than or equal to 1"


def test_an_operation_the_plan_does_not_read_is_refused(tmp_path):
    p = _write(tmp_path, _data({"all_to_all": {"8x1": (1.0, 0.0)}}))
    assert _refusal(p) == (
        f"{p} is damaged at collectives: 'all_to_all' is none of all_gather, reduce_scatter, autoep_exchange"
    )


@pytest.mark.parametrize("key", ["8-2", "0x2", "16x1"], ids=["not-a-shape", "no-ranks", "wider-than-a-node"])
def test_a_group_shape_that_is_not_one_of_this_hardware_is_refused(tmp_path, key):
    p = _write(tmp_path, _data({RS: {"8x1": (1.0, 0.0), key: (1.0, 0.0)}}))
    assert _refusal(p) == f"{p} is damaged at collectives.{RS}: group shape {key!r}"


def test_text_from_the_file_is_escaped_and_cut_where_it_is_echoed(tmp_path):
    """A refusal or warning echoes the file's text on one line, at most ECHO_CHARS of it then '...'."""
    op = "x" * 400
    p = _write(tmp_path, _data({op: {"8x1": (1.0, 0.0)}}))
    assert _refusal(p) == (
        f"{p} is damaged at collectives: {repr(op)[:300]}... is none of all_gather, reduce_scatter, "
        "autoep_exchange"
    )
    cal = _cal(warnings=["a" * 300, "b" * 301, "c\x1b[31m\n"])
    assert calibration.warning_lines(cal) == ["a" * 300, "b" * 300 + "...", "c\\x1b[31m\\n"]
    # --explain prints the file's own words about where it was measured: escaped and cut too
    from dskit.plan.explain import calibration_lines

    hostile = {"device": "GPU\nPASS forged\x1b[31m", "torch": "t" * 400}
    data = _data({AG: {"8x1": (100.0, 1e-5)}})
    data["hardware"].update(hostile)
    head = calibration_lines(Calibration.model_validate(data))[0]
    assert "\n" not in head and "\x1b" not in head and "GPU\\nPASS forged\\x1b[31m" in head and "..." in head


def test_a_fit_without_its_points_is_explained_by_the_fit_alone():
    """A file written by hand may leave out the timed points (the plan reads only the fit)."""
    from dskit.plan.explain import calibration_lines

    lines = calibration_lines(_cal({AG: {"8x1": (100.0, 1e-5)}}))
    assert any(x.strip().startswith("all-gather over 8x1") and x.endswith("a call") for x in lines), lines


def test_load_names_its_field_in_the_readers_refusals(tmp_path):
    with pytest.raises(SpecError) as e:
        calibration.load(
            tmp_path / "none.json", field="hardware.calibration", gpu="cpu", fabric="tcp", procs_per_node=2
        )
    assert e.value.field == "hardware.calibration"


@pytest.mark.parametrize(
    "kw,says",
    [
        ({"gpu": "h200-141gb"}, "gpu 'h100-80gb', this plan has 'h200-141gb'"),
        ({"fabric": "roce"}, "fabric 'infiniband', this plan has 'roce'"),
        ({"procs_per_node": 4}, "procs_per_node 8, this plan has 4"),
    ],
)
def test_a_file_of_other_hardware_is_refused_by_load(tmp_path, kw, says):
    p = _write(tmp_path, _data())
    want = {"gpu": "h100-80gb", "fabric": "infiniband", "procs_per_node": 8}
    assert calibration.load(p, field="g", **want) == calibration.read(p)
    with pytest.raises(SpecError) as e:
        calibration.load(p, field="g", **{**want, **kw})
    assert e.value.field == "g"
    assert e.value.message == f"{p} was measured with {says}: calibrate this hardware"


# ---------------------------------------------------------------------------------------------------
# Which measurement serves a group: its own shape, or for a ring the nearest ring with as many ranks
# per node (Calibration.nearest)


def test_a_shape_is_served_by_its_own_measurement():
    cal = _cal({AG: {"8x2": (40.0, 1e-5), "8x4": (30.0, 2e-5)}})
    assert cal.nearest(AG, "8x2") == (cal.collectives[AG]["8x2"], "8x2")
    assert cal.nearest(RS, "8x2") is None  # an op the file did not time
    assert cal.nearest(AG, "4x2") is None  # no ring with 4 ranks per node


def test_a_ring_across_other_node_counts_takes_the_nearest_measured_ring():
    """The nearest number of nodes, the wider of two as near; fewer nodes than measured too; never an
    in-node ring (no network step) nor one of another width per node."""
    cal = _cal({AG: {"8x1": (400.0, 1e-5), "4x2": (1.0, 0.0), "8x2": (40.0, 2e-5), "8x6": (35.0, 4e-5)}})
    assert cal.nearest(AG, "8x3")[1] == "8x2"
    assert cal.nearest(AG, "8x4")[1] == "8x6"  # as near as 8x2: the wider
    assert cal.nearest(AG, "8x32")[1] == "8x6"
    assert cal.nearest(AG, "8x5")[1] == "8x6"
    wide = _cal({AG: {"8x4": (40.0, 2e-5), "8x8": (30.0, 3e-5)}})
    assert wide.nearest(AG, "8x2")[1] == "8x4"  # fewer nodes than any measured ring
    assert wide.nearest(AG, "8x5")[1] == "8x4"
    inside = _cal({AG: {"8x1": (400.0, 1e-5)}, RS: {"8x1": (400.0, 1e-5), "1x2": (1.0, 0.0)}})
    assert inside.nearest(AG, "8x2") is None and inside.nearest(RS, "8x2") is None


def test_an_exchange_is_served_only_by_its_own_shape():
    """AutoEP's exchange is no ring: a measurement over 8 x 2 says nothing of 8 x 4."""
    cal = _cal({EXCHANGE: {"8x2": (50.0, 1e-4), "8x1": (300.0, 1e-5)}, AG: {"8x2": (40.0, 0.0)}})
    assert cal.nearest(EXCHANGE, "8x2") == (cal.collectives[EXCHANGE]["8x2"], "8x2")
    assert cal.nearest(EXCHANGE, "8x4") is None and cal.nearest(EXCHANGE, "4x1") is None
    assert cal.nearest(AG, "8x4")[1] == "8x2"


# ---------------------------------------------------------------------------------------------------
# Links: a group's rate is its shape's measurement, used as measured


def test_links_of_a_cluster_are_its_catalog_rates_and_its_calibration():
    cal = _cal()
    assert Links.of(H100, IB, cal) == Links(450, 48, cal, "nvlink")
    assert Links.of(L40S, TCP) == Links(32, None, None, "pcie")


def test_group_shapes_follow_autoeps_layout_by_key():
    """The keys the plan looks a calibration up by: integers, as the file writes them."""
    assert {k: g.key for k, g in shapes_of(16, 8, 8).items()} == {
        "dense": "8x2",
        "ep": "8x1",
        "expert_dp": "1x2",
    }
    assert {k: g.key for k, g in shapes_of(32, 8, 2).items()} == {
        "dense": "8x4",
        "ep": "2x1",
        "expert_dp": "4x4",
    }
    assert {k: g.key for k, g in shapes_of(32, 8, 16).items()} == {
        "dense": "8x4",
        "ep": "8x2",
        "expert_dp": "1x2",
    }
    assert {k: g.key for k, g in shapes_of(2, 8, 1).items()} == {
        "dense": "2x1",
        "ep": "1x1",
        "expert_dp": "2x1",
    }
    with pytest.raises(ValueError) as e:
        shapes_of(12, 6, 4)
    assert str(e.value) == "EP 4 straddles nodes of 6 ranks unevenly"


def test_groups_describe_themselves_for_the_sources():
    assert Group(8, 1).describe() == "8 ranks inside a node"
    assert Group(1, 2).describe() == "2 ranks, 1 on each of 2 nodes"


def test_a_measured_shape_takes_its_bus_rate_and_latency_as_measured():
    cal = _cal({AG: {"8x2": (40.0, 3e-5), "8x1": (300.0, 7e-6)}, RS: {"1x2": (20.0, 4e-5)}})
    links = Links.of(H100, IB, cal)
    assert links.rate(AG, Group(8, 2)) == Rate(40.0, 3e-5, MEASURED)
    assert links.rate(AG, Group(8, 1)) == Rate(300.0, 7e-6, MEASURED)
    assert links.rate(RS, Group(1, 2)) == Rate(20.0, 4e-5, MEASURED)
    # what was not measured keeps the catalog's rate
    assert links.rate(RS, Group(8, 2)) == Links.of(H100, IB).rate(RS, Group(8, 2))
    assert links.rate(RS, Group(8, 2)).source == CATALOG


def _ring_us(g: Group, step_us: float) -> float:
    """NCCL's ring latency (tuning.cc), microseconds: 8.4 a call, a step per rank but one, the steps
    between nodes at the network's 9.6."""
    inter = g.nodes - 1
    return 8.4 + (g.size - 1 - inter) * step_us + inter * 9.6


@pytest.mark.parametrize("gpu,step_us", [(H100, 3.4), (L40S, 5.7)], ids=["nvlink", "pcie"])
def test_a_ring_over_more_nodes_scales_the_measured_latency_by_ncclss_model(gpu, step_us):
    """The measured bus rate, and the measured latency times NCCL's latency of the wider ring over its
    latency of the measured one, the steps inside a node at the GPU's own link."""
    cal = _cal({RS: {"8x2": (40.0, 5e-5)}})
    r = Links.of(gpu, IB, cal).rate(RS, Group(8, 4))
    assert r.bus_gbs == 40.0
    assert r.latency_s == approx(5e-5 * _ring_us(Group(8, 4), step_us) / _ring_us(Group(8, 2), step_us))
    assert r.source == f"{MEASURED} on 8x2, latency scaled to 4 nodes by NCCL's ring model"


def test_seconds_are_the_latency_per_call_and_the_bytes_each_rank_moves_at_the_measured_rate():
    """calls x latency + bytes x (g-1)/g / bus rate: halving the bus rate doubles the second part only."""
    fast = Links.of(H100, IB, _cal({AG: {"8x2": (40.0, 3e-5)}}))
    slow = Links.of(H100, IB, _cal({AG: {"8x2": (20.0, 3e-5)}}))
    g, nbytes = Group(8, 2), 8e9
    transfer = nbytes * 15 / 16 / (40.0 * GB)
    assert fast.seconds(AG, g, nbytes, calls=4) == approx(4 * 3e-5 + transfer)
    assert slow.seconds(AG, g, nbytes, calls=4) == approx(4 * 3e-5 + 2 * transfer)
    assert fast.seconds(AG, g, nbytes) == approx(3e-5 + transfer)  # one call unless told
    assert fast.seconds(AG, Group(1, 1), nbytes, calls=4) == 0.0  # a group of one rank moves nothing
    assert Links.of(H100, TCP).seconds(AG, Group(2, 2), nbytes) is None


def test_a_catalog_all_to_all_across_nodes_runs_at_its_slower_half():
    """Each rank sends (g-r)/g of its bytes through its NIC and (r-1)/g over the node's links at once:
    the slower sets the rate. Over InfiniBand the NIC share does for NVLink nodes, PCIe's for L40S. The
    node's links run at NCCL's share of their line rate (A2A_LINK_SHARE), the NICs at the fabric's rate,
    which is already NCCL's."""
    g = Group(8, 2)
    nvlink = Links.of(H100, IB).catalog_rate("all_to_all", g)
    assert nvlink.bus_gbs == approx((15 / 16) / (8 / 16 / 48)) and nvlink.latency_s == approx(9.6e-6)
    pcie = Links.of(L40S, IB).catalog_rate("all_to_all", g)
    assert pcie.bus_gbs == approx((15 / 16) / (7 / 16 / (32 * A2A_LINK_SHARE))) and pcie.source == CATALOG


def test_only_the_all_to_all_takes_nccls_share_of_a_nodes_line_rate():
    """Inside a node the all-to-all runs at A2A_LINK_SHARE of the link's line rate (NCCL's protocol
    overhead, nccl-tests issue #212); the rings keep the line rate the catalog gives."""
    inside = Links.of(H100, IB)
    assert inside.catalog_rate("all_to_all", Group(8, 1)).bus_gbs == approx(450 * A2A_LINK_SHARE)
    assert A2A_LINK_SHARE < 1
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        assert inside.catalog_rate(op, Group(8, 1)).bus_gbs == 450


def test_the_exchange_is_read_at_the_ep_groups_own_shape_only():
    cal = _cal({EXCHANGE: {"8x1": (90.0, 2e-5), "8x2": (30.0, 6e-5)}})
    links = Links.of(H100, IB, cal)
    assert links.exchange(Group(8, 1)) == Rate(90.0, 2e-5, MEASURED)
    assert links.exchange(Group(8, 2)) == Rate(30.0, 6e-5, MEASURED)
    assert links.exchange(Group(8, 4)) is None and links.exchange(Group(4, 1)) is None
    assert Links.of(H100, IB).exchange(Group(8, 1)) is None


# ---------------------------------------------------------------------------------------------------
# ZeRO's collectives over each group shape (speed._collectives_s)

#: (bytes gathered per layer pass, bytes reduced per micro-step, group) for the dense and expert groups
TRAFFIC = ((3e9, 2e9, "dense"), (1e9, 5e8, "expert_dp"))
LAYERS = {"dense": 4, "expert_dp": 3}
#: measured (bus GB/s, latency s) per op over the dense (8 x 2) and expert-data-parallel (1 x 2) shapes
RATES = {AG: {"8x2": (40.0, 3e-5), "1x2": (25.0, 5e-5)}, RS: {"8x2": (30.0, 4e-5), "1x2": (15.0, 6e-5)}}


def _t(op: str, key: str, nbytes: float, calls: float, rates=RATES) -> float:
    """One group's seconds by the rule: calls x latency + bytes x (g-1)/g / bus rate."""
    gbs, lat = rates[op][key]
    g = Group(*(int(x) for x in key.split("x")))
    return calls * lat + nbytes * (g.size - 1) / g.size / (gbs * GB)


def _zero(
    stage: int,
    *,
    rates=RATES,
    world: int = 16,
    per_node: int = 8,
    ep: int = 8,
    frac: float = 0.5,
    windows=(0.0, 0.0, 0.0),
    share: float = 1.0,
    links: Links | None = None,
    traffic=TRAFFIC,
    **kw,
) -> tuple[float, float, list[str]]:
    unknown: list[str] = []
    links = links or Links.of(H100, IB, _cal(rates))
    shapes = shapes_of(world, per_node, ep)
    passes = speed.Passes(LAYERS["dense"], LAYERS["expert_dp"], frac)
    per_micro, per_step = speed._collectives_s(traffic, shapes, links, stage, passes, windows, share, unknown)
    return per_micro + speed._sync_s(shapes, stage, passes, links, **kw), per_step, unknown


def _zero3(frac: float = 0.5, rates=RATES) -> tuple[list[float], float]:
    """ZeRO-3's seconds over both groups: the gathers by pass (forward, backward, recomputed forwards; a
    gather of each layer the group holds in every pass, the recompute's of the recomputed share of
    them), and the gradients' reduce-scatters of the backward."""
    gathers, reduce = [0.0, 0.0, 0.0], 0.0
    for (gathered, reduced, _), key in zip(TRAFFIC, ("8x2", "1x2"), strict=True):
        calls = LAYERS["dense" if key == "8x2" else "expert_dp"]
        gathers[0] += _t(AG, key, gathered, calls, rates)
        gathers[1] += _t(AG, key, gathered, calls, rates)
        gathers[2] += _t(AG, key, gathered * frac, calls * frac, rates) if frac else 0.0
        reduce += _t(RS, key, reduced, calls, rates)
    return gathers, reduce


def _zero3_total(frac: float = 0.5, rates=RATES) -> float:
    gathers, reduce = _zero3(frac, rates)
    return sum(gathers) + reduce


def test_zero3_takes_every_groups_measured_rates_where_nothing_hides_them():
    """With no compute to run behind, ZeRO-3's per-micro-step seconds are every pass's transfers over
    each group's own measured rates, plus the fitted synchronisation per layer pass; nothing per step."""
    per_micro, per_step, unknown = _zero(3)
    assert per_micro == approx(_zero3_total() + speed.SYNC_LAYER_PASS_S * 4 * 2.5)
    assert per_step == 0.0 and unknown == []
    no_recompute, _, _ = _zero(3, frac=0.0)
    assert no_recompute == approx(_zero3_total(0.0) + speed.SYNC_LAYER_PASS_S * 4 * 2)


@pytest.mark.parametrize("key", ["8x2", "1x2"], ids=["dense", "expert-dp"])
@pytest.mark.parametrize("op", [AG, RS])
def test_halving_one_shapes_measured_rate_doubles_that_groups_transfers_only(op, key):
    """The dense group's rate moves only the dense transfers, the expert group's only the experts';
    three times the latency moves only the calls' part."""
    base = _zero(3)[0]
    half = {o: dict(v) for o, v in RATES.items()}
    half[op][key] = (RATES[op][key][0] / 2, RATES[op][key][1])
    assert _zero3_total(rates=half) > _zero3_total()
    assert _zero(3, rates=half)[0] == approx(base + _zero3_total(rates=half) - _zero3_total())
    slower = {o: dict(v) for o, v in RATES.items()}
    slower[op][key] = (RATES[op][key][0], RATES[op][key][1] * 3)
    assert _zero(3, rates=slower)[0] == approx(base + _zero3_total(rates=slower) - _zero3_total())


def test_each_pass_of_zero3_runs_behind_its_own_compute():
    """Per pass, behind that pass's compute: of the gathers only the share the live limit lets start
    ahead (`share`) hides, the rest waits for its layer, exposed; the backward's reduce-scatters go on
    DeepSpeed's reduce stream as the gradients come, whole (no live limit holds them back). What the
    compute cannot cover is exposed."""
    gathers, reduce = _zero3()
    share = 0.6
    windows = (gathers[0] / 2, (gathers[1] * share + reduce) / 2, gathers[2] * 2)  # the recompute's hidden
    per_micro, _, _ = _zero(3, windows=windows, share=share, sync_layer_pass_s=0.0)
    frees = (0.0, reduce, 0.0)
    want = sum(
        g * (1 - share) + max(0.0, g * share + f - w) for g, w, f in zip(gathers, windows, frees, strict=True)
    )
    assert per_micro == approx(want)
    assert 0 < want < sum(gathers) + reduce


def test_a_passs_window_is_its_share_of_the_compute():
    """A LoRA run's forward is its own share of the FLOPs (not a third): the forward, the backward and
    the recomputed forwards' shares of one micro-step's compute."""
    whole = 1 + 0.5 * 0.25
    assert speed.compute_windows(0.6, 0.5, 0.25) == (
        approx(0.6 * 0.25 / whole),
        approx(0.6 * 0.75 / whole),
        approx(0.6 * 0.5 * 0.25 / whole),
    )
    assert speed.compute_windows(0.6, 0.5, None) == (
        approx(0.6 / 3 / (1 + 0.5 / 3)),
        approx(0.6 * 2 / 3 / (1 + 0.5 / 3)),
        approx(0.6 * 0.5 / 3 / (1 + 0.5 / 3)),
    )


def test_zero2_reduces_behind_the_backward_and_gathers_the_weights_once_per_step():
    per_micro, per_step, _ = _zero(2, windows=(1.0, 0.0, 2.0), sync_layer_pass_s=0.0)
    reduce = _t(RS, "8x2", 2e9, 4) + _t(RS, "1x2", 5e8, 3)
    assert per_micro == approx(reduce)
    assert per_step == approx(_t(AG, "8x2", 2e9, 1) + _t(AG, "1x2", 5e8, 1))
    hidden, _, _ = _zero(2, windows=(9.0, reduce / 3, 9.0), sync_layer_pass_s=0.0)
    assert hidden == approx(reduce * 2 / 3)


def test_zero1_reduces_and_gathers_once_per_step_exposed():
    per_micro, per_step, _ = _zero(1, windows=(1.0, 1.0, 1.0), sync_layer_pass_s=0.0)
    assert per_micro == 0.0
    assert per_step == approx(
        sum(_t(op, k, b, 1) for op in (AG, RS) for k, b in (("8x2", 2e9), ("1x2", 5e8)))
    )


def test_the_synchronisation_is_paid_where_ranks_synchronise():
    """ZeRO-3 synchronises every layer pass on more than one rank; ZeRO-1/2 only where AutoEP's count
    exchange runs (EP > 1); SYNC_LAYER_PASS_S per layer pass unless told (a CPU rank: 0)."""
    one = {AG: {}, RS: {}}
    pair = {AG: {"2x1": (10.0, 0.0)}, RS: {"2x1": (10.0, 0.0)}}
    none = ((0.0, 0.0, "dense"), (0.0, 0.0, "expert_dp"))
    sync = speed.SYNC_LAYER_PASS_S * 4 * 2.5
    assert _zero(3, rates=one, world=1, per_node=1, ep=1, traffic=none)[0] == 0.0
    assert _zero(3, rates=pair, world=2, per_node=2, ep=1, traffic=none)[0] == approx(sync)
    assert _zero(2, rates=pair, world=2, per_node=2, ep=1, traffic=none)[0] == 0.0
    assert _zero(2, rates=pair, world=2, per_node=2, ep=2, traffic=none)[0] == approx(sync)
    assert _zero(1, rates=pair, world=2, per_node=2, ep=2, traffic=none, sync_layer_pass_s=1.0)[0] == 10.0


def test_a_measured_exchange_holds_the_count_exchanges_synchronisation():
    """Under ZeRO-1/2 the synchronisation is AutoEP's count exchange, which `dskit calibrate` times as
    part of each dispatch-and-combine pair: with the exchange measured at the EP group's shape it is not
    added again; measured at another shape, or under ZeRO-3 (whose gathers synchronise), it still is."""
    none = ((0.0, 0.0, "dense"), (0.0, 0.0, "expert_dp"))
    sync = speed.SYNC_LAYER_PASS_S * 4 * 2.5
    rates = {AG: {"2x1": (10.0, 0.0)}, RS: {"2x1": (10.0, 0.0)}}
    measured = {**rates, EXCHANGE: {"2x1": (50.0, 1e-5)}}
    other = {**rates, EXCHANGE: {"8x1": (50.0, 1e-5)}}
    for stage in (1, 2):
        assert _zero(stage, rates=measured, world=2, per_node=2, ep=2, traffic=none)[0] == 0.0
        assert _zero(stage, rates=other, world=2, per_node=2, ep=2, traffic=none)[0] == approx(sync)
    assert _zero(3, rates=measured, world=2, per_node=2, ep=2, traffic=none)[0] == approx(sync)


def test_a_group_of_one_rank_costs_nothing_and_needs_no_rate():
    """EP 8 on one node of 8: every expert-data-parallel group is one rank. On a CPU profile (no catalog
    link) such a group has no rate at all and is still not 'unknown'."""
    rates = {AG: {"8x1": (100.0, 1e-5)}, RS: {"8x1": (50.0, 2e-5)}}
    per_micro, _, unknown = _zero(3, rates=rates, world=8, per_node=8, ep=8, frac=0.0, sync_layer_pass_s=0.0)
    assert per_micro == approx(2 * _t(AG, "8x1", 3e9, 4, rates) + _t(RS, "8x1", 2e9, 4, rates))
    assert unknown == []
    cpu = Links.of(CPU, TCP, _cal(rates, gpu="cpu", fabric="tcp", nodes=1))
    per_micro, _, unknown = _zero(3, links=cpu, world=8, per_node=8, ep=8, frac=0.0, sync_layer_pass_s=0.0)
    assert per_micro == approx(2 * _t(AG, "8x1", 3e9, 4, rates) + _t(RS, "8x1", 2e9, 4, rates))
    assert unknown == []


def test_a_group_without_a_rate_is_named_and_left_out_and_the_others_still_count():
    """Over tcp (no catalog rate across nodes) a calibration that timed only the expert groups' shape:
    the dense group is named unknown, once, and the expert group's measured seconds still count."""
    rates = {AG: {"1x2": RATES[AG]["1x2"]}, RS: {"1x2": RATES[RS]["1x2"]}}
    links = Links.of(H100, TCP, _cal(rates, fabric="tcp"))
    per_micro, _, unknown = _zero(3, links=links, rates=rates, frac=0.0, sync_layer_pass_s=0.0)
    assert per_micro == approx(2 * _t(AG, "1x2", 1e9, 3) + _t(RS, "1x2", 5e8, 3))
    assert unknown == ["ZeRO-3 collectives across nodes (fabric bandwidth unknown)"]
    # the other way round: a two-rank expert group without a rate is named too
    dense = {AG: {"8x2": RATES[AG]["8x2"]}, RS: {"8x2": RATES[RS]["8x2"]}}
    links = Links.of(H100, TCP, _cal(dense, fabric="tcp"))
    per_micro, _, unknown = _zero(1, links=links, sync_layer_pass_s=0.0)
    assert unknown == ["ZeRO-1 collectives across nodes (fabric bandwidth unknown)"]


# ---------------------------------------------------------------------------------------------------
# AutoEP's exchange (speed._all_to_all_s)

V2 = dict(catalog.model("deepseek-v2-lite").config, num_hidden_layers=4)
SEQ = 4096
S2 = ModelShape.from_config(V2)
C2 = counts(S2, SEQ)


def _sent(tokens: int, ep: int) -> float:
    """Bytes a rank sends per dispatch-and-combine pair: every routed copy (top-k per token) of a hidden
    state in 16 bits, both ways, the (ep-1)/ep of it bound for other ranks."""
    return 2 * tokens * V2["num_experts_per_tok"] * V2["hidden_size"] * 2 * (ep - 1) / ep


def _a2a(
    links: Links, ep: int, frac: float = 0.0, tokens: int = SEQ, per_node: int = 8
) -> tuple[float, list]:
    unknown: list[str] = []
    world = max(ep, per_node)
    g = shapes_of(world, per_node, ep)["ep"]
    return speed._all_to_all_s(S2, g, links, tokens, frac, unknown), unknown


def test_a_measured_exchange_is_taken_as_measured_once_per_pair():
    """A dispatch-and-combine pair per MoE layer and pass costs the measured latency once and the bytes
    at the measured rate: no share of the link and no A2A_PAIR_FIXED_S (the measurement already holds
    AutoEP's losses), no second latency."""
    links = Links.of(H100, IB, _cal({EXCHANGE: {"8x1": (60.0, 2e-5), "2x1": (80.0, 1e-5)}}))
    pairs = C2.moe_layers * 2.5
    seconds, unknown = _a2a(links, 8, frac=0.5)
    assert seconds == approx(pairs * (2e-5 + _sent(SEQ, 8) / (60.0 * GB)))
    assert unknown == []
    halved = Links.of(H100, IB, _cal({EXCHANGE: {"8x1": (30.0, 2e-5)}}))
    assert _a2a(halved, 8, frac=0.5)[0] == approx(pairs * (2e-5 + 2 * _sent(SEQ, 8) / (60.0 * GB)))
    assert _a2a(links, 2)[0] == approx(C2.moe_layers * 2 * (1e-5 + _sent(SEQ, 2) / (80.0 * GB)))
    assert _a2a(links, 1) == (0.0, [])


def test_without_a_measured_exchange_the_catalog_rate_adds_autoeps_fitted_fixed_cost():
    """Unmeasured, the pair is two all-to-alls at the catalog's rate (one step of latency each), NVLink
    at NCCL's share of its line rate (A2A_LINK_SHARE) and the NICs at the fabric's rate, which is already
    NCCL's, plus AutoEP's fitted fixed cost per pair (A2A_PAIR_FIXED_S)."""
    links = Links.of(H100, IB, _cal({EXCHANGE: {"8x2": (60.0, 2e-5)}}))  # another shape's
    pairs = C2.moe_layers * 2.5
    fixed = speed.A2A_PAIR_FIXED_S
    seconds, _ = _a2a(links, 8, frac=0.5)
    nvlink = 450 * A2A_LINK_SHARE
    assert seconds == approx(pairs * (fixed + 2 * 3.4e-6 + _sent(SEQ, 8) / (nvlink * GB)))
    across, _ = _a2a(Links.of(H100, IB), 16)
    bus = (15 / 16) / max(8 / 16 / 48, 7 / 16 / nvlink)  # the NIC share sets the pace
    assert across == approx(C2.moe_layers * 2 * (fixed + 2 * 9.6e-6 + _sent(SEQ, 16) / (bus * GB)))
    seconds, unknown = _a2a(Links.of(H100, TCP), 16)
    assert seconds == 0.0 and unknown == ["all-to-all across nodes (fabric bandwidth unknown)"]


# ---------------------------------------------------------------------------------------------------
# The probes (dskit/calibrate/scales.py): a factor per fitted term, against the reference machine

REF = reference("gpu").compute
REF_CPU = reference("cpu")


def test_the_reference_machines_are_the_bench_h200_and_the_cpu_one():
    assert reference() == reference("gpu") and reference().hardware.gpu == "h200-141gb"
    assert REF_CPU.hardware.gpu == "cpu" and kind_of("cpu") == "cpu" and kind_of("h100-80gb") == "gpu"


def test_without_a_calibration_every_term_is_as_fitted():
    s = factors(None)
    assert (s.compute, s.attention, s.host, s.cpu_adam, s.gemm_tflops) == (1.0, 1.0, 1.0, 1.0, None)
    assert s.sources == dict.fromkeys(TERMS, FITTED)
    assert factors(None, "cpu").sources == dict.fromkeys(TERMS, fitted("cpu"))


def test_a_calibration_without_probes_scales_nothing():
    s = factors(_cal())
    assert (s.compute, s.attention, s.host, s.cpu_adam, s.gemm_tflops) == (1.0, 1.0, 1.0, 1.0, None)
    assert s.sources == dict.fromkeys(TERMS, FITTED)


def test_gemm_and_attention_probes_compare_as_shares_of_each_gpus_peak():
    """An A100 (312 TFLOP/s) at the reference H200's (989) share of peak is the reference: factor 1;
    at half that share, 2. Each probe scales its own term."""
    share = A100.peak_tflops_bf16 / H200.peak_tflops_bf16
    same = factors(_cal(gpu="a100-80gb", compute={"gemm_tflops": REF.gemm_tflops * share}))
    assert (
        same.compute == approx(1.0) and same.attention == 1.0 and same.gemm_tflops == REF.gemm_tflops * share
    )
    s = factors(
        _cal(
            gpu="a100-80gb",
            compute={
                "gemm_tflops": REF.gemm_tflops * share / 2,
                "attention_tflops": REF.attention_tflops * share / 4,
            },
        )
    )
    assert (s.compute, s.attention) == (approx(2.0), approx(4.0))
    assert s.sources == {
        "compute": f"{SCALED} (x2.00)",
        "attention": f"{SCALED} (x4.00)",
        "host": FITTED,
        "cpu_adam": FITTED,
    }
    only_attention = factors(_cal(compute={"attention_tflops": REF.attention_tflops / 2}))
    assert (only_attention.compute, only_attention.attention) == (1.0, approx(2.0))


def test_host_and_cpu_adam_probes_scale_by_their_ratio_to_the_reference():
    s = factors(
        _cal(compute={"host_layer_pass_s": REF.host_layer_pass_s * 1.3}, cpu_adam=2 * 2.4162020599999323)
    )
    assert (s.compute, s.attention, s.host, s.cpu_adam) == (1.0, 1.0, approx(1.3), approx(2.0))
    assert s.cpu_adam == approx(2 * 2.4162020599999323 / reference().cpu_adam.core_s_per_bparam)
    assert s.sources == {
        "compute": FITTED,
        "attention": FITTED,
        "host": f"{SCALED} (x1.30)",
        "cpu_adam": f"{SCALED} (x2.00)",
    }


def test_a_cpu_calibration_is_compared_with_the_cpu_reference_whatever_kind_is_asked():
    """A CPU's compute scales by its host probe, as its host timeline does (the tiny models' kernels are
    bound by per-operation overhead, not by the GEMM probe's rate, which stays the MFU's peak), and the
    source says so."""
    ref = REF_CPU
    cal = _cal(
        gpu="cpu",
        fabric="tcp",
        nodes=1,
        per_node=2,
        compute={"gemm_tflops": 1.0, "host_layer_pass_s": ref.compute.host_layer_pass_s * 1.5},
        cpu_adam=ref.cpu_adam.core_s_per_bparam * 3,
    )
    s = factors(cal)
    assert factors(cal, "gpu") == factors(cal, "cpu") == s
    assert (s.compute, s.attention, s.host, s.cpu_adam) == (approx(1.5), 1.0, approx(1.5), approx(3.0))
    assert s.gemm_tflops == 1.0
    assert s.sources == {
        "compute": f"{scaled('cpu')} (x1.50)",  # by the host probe
        "attention": fitted("cpu"),
        "host": f"{scaled('cpu')} (x1.50)",
        "cpu_adam": f"{scaled('cpu')} (x3.00)",
    }


def test_a_cpu_calibration_without_a_host_probe_leaves_the_compute_as_fitted():
    """The GEMM probe does not scale a CPU rank's compute: without the host probe it stays the fitted rate."""
    s = factors(_cal(gpu="cpu", fabric="tcp", nodes=1, per_node=2, compute={"gemm_tflops": 1.0}))
    assert (s.compute, s.host, s.gemm_tflops) == (1.0, 1.0, 1.0)
    assert s.sources["compute"] == s.sources["host"] == fitted("cpu")


def test_a_gpu_without_a_bf16_peak_is_not_scaled_by_its_gemm_or_attention_probe():
    """The GPU probes compare as shares of each GPU's bf16 peak, which the catalog does not give a V100:
    its readings scale nothing, and the sources say the terms are fitted."""
    cal = _cal(gpu="v100-32gb", compute={"gemm_tflops": 100.0, "attention_tflops": 50.0})
    s = factors(cal)
    assert (s.compute, s.attention) == (1.0, 1.0)
    assert s.sources["compute"] == s.sources["attention"] == FITTED


# ---------------------------------------------------------------------------------------------------
# The probes in a GPU step (speed.predict)

ONE = speed.Layout(world=1, per_node=1, ep_size=1)
F2 = flops_per_token(C2)
#: the attention FLOPs of a token, which the attention probe scales; the rest, the GEMM probe's
ATTENTION = min(C2.attn_flops_per_token, F2)


def _gpu_step(
    cal: Calibration | None = None, *, gpu=H100, layout=ONE, grad_accum: int = 2, flops: float = F2, **kw
) -> speed.StepTime:
    candidate = Candidate(
        ep_size=layout.ep_size,
        micro_batch=1,
        ckpt_every=kw.pop("ckpt_every", 0),
        offload=kw.pop("offload", False),
        zero_stage=kw.pop("zero_stage", 3),
    )
    return speed.predict(
        Workload(S2, C2, flops, seq_len=SEQ, per_rank=grad_accum, **kw),
        candidate,
        Cluster(gpu, world=layout.world, per_node=layout.per_node, peak_tflops=gpu.peak_tflops_bf16),
        Links.of(gpu, IB, cal),
        factors(cal),
    )


def _compute_unit(flops: float, gpu=H100, grad_accum: int = 2) -> float:
    """Seconds of `flops` per token over a step's tokens at GEMM_EFFICIENCY of the GPU's peak."""
    return grad_accum * SEQ * flops / (gpu.peak_tflops_bf16 * 1e12 * speed.GEMM_EFFICIENCY)


def test_a_gemm_probe_at_half_the_reference_share_doubles_the_non_attention_compute():
    base = _gpu_step()
    half = _gpu_step(_cal(compute={"gemm_tflops": REF.gemm_tflops / 2}))
    assert half.compute_s == approx(base.compute_s + _compute_unit(F2 - ATTENTION))
    assert half.host_s == base.host_s and half.optimizer_s == base.optimizer_s


def test_an_attention_probe_scales_only_the_attention_flops():
    base = _gpu_step()
    slow = _gpu_step(_cal(compute={"attention_tflops": REF.attention_tflops / 3}))
    assert slow.compute_s == approx(base.compute_s + _compute_unit(2 * ATTENTION))
    both = _gpu_step(
        _cal(compute={"gemm_tflops": REF.gemm_tflops / 2, "attention_tflops": REF.attention_tflops / 2})
    )
    assert both.compute_s == approx(base.compute_s + _compute_unit(F2))


def test_the_probed_compute_counts_the_recomputed_forwards_and_compiled_savings_as_before():
    """A checkpointed layer's forward runs again (a third of its FLOPs) and compiling takes its share
    off: the probe's factor multiplies all of it, the saving is not scaled twice."""
    base = _gpu_step(ckpt_every=1, compiled=True)
    half = _gpu_step(_cal(compute={"gemm_tflops": REF.gemm_tflops / 2}), ckpt_every=1, compiled=True)
    want = _compute_unit(F2 - ATTENTION) * (1 + 1 / 3) * (1 - speed.COMPILED_COMPUTE_SAVING)
    assert half.compute_s == approx(base.compute_s + want)


def test_the_probed_compute_of_a_lora_run_recomputes_its_own_forward_share():
    t = adapters.tuning(
        S2, C2, targets=["attention", "shared_experts"], r=16, dropout=0.0, base_precision="bf16"
    )
    flops = t.flops_per_token(C2)
    base = _gpu_step(ckpt_every=1, tuning=t, flops=flops)
    half = _gpu_step(_cal(compute={"gemm_tflops": REF.gemm_tflops / 2}), ckpt_every=1, tuning=t, flops=flops)
    recompute = 1 + 1.0 * t.forward_share(C2)
    want = _compute_unit(flops - ATTENTION) * recompute * speed.LORA_COMPUTE_FACTOR
    assert t.forward_share(C2) != 1 / 3 and half.compute_s == approx(base.compute_s + want)


def test_the_probed_compute_takes_the_fp8_saving_at_the_same_rate():
    """FP8 products take their measured saving off the bf16-equivalent FLOPs (docs/trainer.md "FP8
    training"), and a GEMM probe scales what is left: the saving too, once, not added or divided."""
    fp8 = Fp8Compute(linear_flops_per_token=F2 / 4, linear_speedup=1.5)
    saved = fp8.flops_saved_per_token
    assert saved == approx(F2 / 12)
    base = _gpu_step()
    for factor in (1, 2):
        cal = None if factor == 1 else _cal(compute={"gemm_tflops": REF.gemm_tflops / factor})
        step = _gpu_step(cal, fp8=fp8)
        want = base.compute_s + _compute_unit(F2 - ATTENTION) * (factor - 1) - _compute_unit(saved) * factor
        assert step.compute_s == approx(want)


def test_zero3_on_two_ranks_synchronises_in_the_step_whatever_exchange_was_measured():
    """ZeRO-3's synchronisation per layer pass (SYNC_LAYER_PASS_S) reaches the step with more than one
    rank, with or without EP, and a measured AutoEP exchange does not take it away (its gathers
    synchronise): with gathers at a rate that makes their bytes free, the collectives are the sync."""
    free = {AG: {"2x1": (1e5, 0.0)}, RS: {"2x1": (1e5, 0.0)}}
    sync = speed.SYNC_LAYER_PASS_S * S2.layers * 2 * 2  # 2 passes (no checkpointing), 2 micro-steps
    for ep, rates in ((1, free), (2, {**free, EXCHANGE: {"2x1": (50.0, 1e-5)}})):
        step = _gpu_step(_cal(rates), layout=speed.Layout(world=2, per_node=2, ep_size=ep))
        assert abs(step.collectives_s - sync) < 1e-2 * sync, (ep, step.collectives_s, sync)


def test_the_probed_compute_keeps_the_compiled_attention_saving_of_zero12():
    base = _gpu_step(zero_stage=2, compiled_attention=True)
    half = _gpu_step(
        _cal(compute={"gemm_tflops": REF.gemm_tflops / 2}), zero_stage=2, compiled_attention=True
    )
    want = _compute_unit(F2 - ATTENTION) * (1 - speed.COMPILED_ATTENTION_SAVING)
    assert half.compute_s == approx(base.compute_s + want)


def test_a_host_probe_scales_the_host_timeline_by_its_ratio():
    base = _gpu_step(grad_accum=3)
    slow = _gpu_step(_cal(compute={"host_layer_pass_s": REF.host_layer_pass_s * 1.3}), grad_accum=3)
    assert slow.host_s == approx(1.3 * base.host_s)
    passes = V2["num_hidden_layers"] * 2
    assert base.host_s == approx(3 * (speed.HOST_LAYER_PASS_S * passes + speed.HOST_MICRO_STEP_S))
    assert slow.compute_s == base.compute_s


def test_a_cpu_adam_probe_scales_the_offloaded_optimizer_s_host_part_only():
    """CPU Adam x2: the offloaded step's core-seconds double, the PCIe round trip does not."""
    layout = speed.Layout(world=2, per_node=2, ep_size=1)
    local = C2.total / 2
    adam = local / 1e9 * speed.CPU_ADAM_CORE_S_PER_BPARAM / 8  # 8 host threads per rank
    pcie = local * speed.OFFLOAD_BYTES_PER_PARAM / (H100.pcie_gbs * GB)
    base = _gpu_step(layout=layout, offload=True)
    slow = _gpu_step(_cal(cpu_adam=2 * reference().cpu_adam.core_s_per_bparam), layout=layout, offload=True)
    assert base.optimizer_s == approx(adam + pcie)
    assert slow.optimizer_s == approx(2 * adam + pcie)
    resident = _gpu_step(_cal(cpu_adam=2 * reference().cpu_adam.core_s_per_bparam), layout=layout)
    assert resident.optimizer_s == _gpu_step(layout=layout).optimizer_s  # no offload, no CPU Adam


# ---------------------------------------------------------------------------------------------------
# A GPU plan's collectives and exchange from the file (speed.predict), and where it says they came from

EP8 = speed.Layout(world=16, per_node=8, ep_size=8)


def test_a_zero1_step_pays_each_groups_measured_transfers_at_the_boundary():
    """ZeRO-1 gathers the weights and reduces the gradients once per step, exposed: halving the dense
    shape's measured rate adds the dense transfers once more, nothing else."""
    rates = {AG: {"8x2": (40.0, 3e-5), "1x2": (25.0, 5e-5)}, RS: {"8x2": (30.0, 4e-5), "1x2": (15.0, 6e-5)}}
    half = {op: {**v, "8x2": (v["8x2"][0] / 2, v["8x2"][1])} for op, v in rates.items()}
    base = _gpu_step(_cal(rates), layout=EP8, zero_stage=1)
    slow = _gpu_step(_cal(half), layout=EP8, zero_stage=1)
    (_, dense, _), (_, routed, _) = speed._zero_groups(S2, C2, EP8, None)
    moved = dense * 15 / 16 / GB
    assert slow.boundary_s == approx(base.boundary_s + moved / 40.0 + moved / 30.0)
    assert slow.collectives_s == base.collectives_s
    copy = speed._grad_copy_s(*speed._trained_grads(C2, EP8, None), EP8, H100)
    exposed = sum(_t(op, k, b, 1, rates) for op in (AG, RS) for k, b in (("8x2", dense), ("1x2", routed)))
    assert base.boundary_s == approx(copy + exposed)


def test_a_gpu_step_takes_the_measured_exchange_and_says_where_each_rate_came_from():
    cal = _cal({AG: {"8x2": (40.0, 3e-5), "1x2": (25.0, 5e-5)}, EXCHANGE: {"8x1": (60.0, 2e-5)}})
    step = _gpu_step(cal, layout=EP8, grad_accum=3)
    assert step.all_to_all_s == approx(3 * C2.moe_layers * 2 * (2e-5 + _sent(SEQ, 8) / (60.0 * GB)))
    assert step.sources == (
        ("dense group (16 ranks, 8 on each of 2 nodes)", MEASURED),
        ("expert-dp group (2 ranks, 1 on each of 2 nodes)", MEASURED),
        ("ep group (8 ranks inside a node)", f"{MEASURED}: AutoEP's dispatch and combine"),
        *dict.fromkeys(TERMS, FITTED).items(),
    )
    unmeasured = _gpu_step(_cal(), layout=EP8)
    assert unmeasured.sources[:3] == (
        ("dense group (16 ranks, 8 on each of 2 nodes)", CATALOG),
        ("expert-dp group (2 ranks, 1 on each of 2 nodes)", CATALOG),
        (
            "ep group (8 ranks inside a node)",
            f"{CATALOG}; AutoEP's fixed cost per dispatch and combine (A2A_PAIR_FIXED_S) {FITTED}",
        ),
    )


def test_groups_of_one_rank_have_no_source_and_groups_of_two_have_one():
    one_node = _gpu_step(_cal(), layout=speed.Layout(world=8, per_node=8, ep_size=8))
    assert [name for name, _ in one_node.sources[:2]] == [
        "dense group (8 ranks inside a node)",
        "ep group (8 ranks inside a node)",
    ]
    pair = _gpu_step(_cal(), layout=speed.Layout(world=2, per_node=2, ep_size=1))
    assert [name for name, _ in pair.sources[:3]] == [
        "dense group (2 ranks inside a node)",
        "expert-dp group (2 ranks inside a node)",
        "compute",
    ]
    ep2 = _gpu_step(_cal(), layout=speed.Layout(world=2, per_node=2, ep_size=2))
    assert [name for name, _ in ep2.sources[:2]] == [
        "dense group (2 ranks inside a node)",
        "ep group (2 ranks inside a node)",
    ]
    tcp = speed.predict(
        Workload(S2, C2, F2, seq_len=SEQ, per_rank=1), Candidate(ep_size=16, micro_batch=1, ckpt_every=0, offload=False),
        Cluster(H100, world=32, per_node=8, peak_tflops=989), Links.of(H100, TCP), factors(None),
    )  # fmt: skip
    assert [name for name, _ in tcp.sources] == [*TERMS]  # nothing known across nodes: no rate to name


# ---------------------------------------------------------------------------------------------------
# CPU ranks (speed._cpu_step): the compute at CPU_COMPUTE_TFLOPS over the host probe's ratio, the GEMM
# probe the MFU's peak, and every other term the file's

TINY = dict(catalog.model("tiny-v2-experts").config)
ST = ModelShape.from_config(TINY)
CT = counts(ST, 128)
FT = flops_per_token(CT)
#: the CPU calibration's readings: 0.5 TFLOP/s GEMM, host x1.5 and CPU Adam x2 the CPU reference's
CPU_RATES = {AG: {"2x1": (2.0, 3e-4)}, RS: {"2x1": (1.5, 4e-4)}, EXCHANGE: {"2x1": (0.8, 5e-4)}}


def _cpu_cal(rates=CPU_RATES) -> Calibration:
    return _cal(
        rates,
        gpu="cpu",
        fabric="tcp",
        nodes=1,
        per_node=2,
        compute={"gemm_tflops": 0.5, "host_layer_pass_s": REF_CPU.compute.host_layer_pass_s * 1.5},
        cpu_adam=REF_CPU.cpu_adam.core_s_per_bparam * 2,
    )


def _cpu_step(
    cal: Calibration | None, *, ep: int, stage: int, ckpt_every: int = 2, tuning=None, threads: int = 3
):
    return speed.predict(
        Workload(ST, CT, FT if tuning is None else tuning.flops_per_token(CT), seq_len=128, per_rank=2 * 3, tuning=tuning),
        Candidate(ep_size=ep, micro_batch=2, ckpt_every=ckpt_every, offload=False, zero_stage=stage),
        Cluster(CPU, world=2, per_node=2, host_threads=threads),
        Links.of(CPU, TCP, cal),
        factors(cal),
    )  # fmt: skip


def _cpu_terms(*, ep: int, stage: int, frac: float, tuning=None, rates=CPU_RATES, threads: int = 3) -> dict:
    """A CPU rank's step by the rule (dskit/plan/speed.py "CPU ranks"): FLOPs at CPU_COMPUTE_TFLOPS over
    the host probe's factor; ZeRO's transfers at the measured rates, none hidden, no fitted
    synchronisation; AutoEP's exchange as measured; the host constants times the host probe's factor;
    the optimizer's core-seconds times CPU Adam's, its host part times the host's."""
    layers, moe, T, ga = TINY["num_hidden_layers"], CT.moe_layers, 2 * 128, 3
    layout = speed.Layout(world=2, per_node=2, ep_size=ep)
    fwd = 1 / 3 if tuning is None else tuning.forward_share(CT)
    flops = FT if tuning is None else tuning.flops_per_token(CT)
    (gd, rd, _), (ge, re_, _) = speed._zero_groups(ST, CT, layout, tuning)
    groups = [(gd, rd, layers)] + ([(ge, re_, moe)] if ep == 1 else [])  # EP 2: one-rank expert groups

    def t(op, nbytes, calls):
        return _t(op, "2x1", nbytes, calls, rates)

    collectives = boundary = 0.0
    for g, r, calls in groups:
        if stage == 3:
            collectives += (2 + frac) * t(AG, g, calls) + t(RS, r, calls)
        elif stage == 2:
            collectives += t(RS, r, calls)
            boundary += t(AG, r, 1)
        else:
            boundary += t(AG, r, 1) + t(RS, r, 1)
    gbs, lat = rates[EXCHANGE]["2x1"]
    a2a = (
        moe
        * (2 + frac)
        * (lat + 2 * T * TINY["num_experts_per_tok"] * TINY["hidden_size"] * 2 / 2 / (gbs * GB))
    )
    passes = layers * (2 + frac)
    host = (speed.CPU_HOST_LAYER_PASS_S if stage == 3 else speed.CPU_HOST_LAYER_PASS_UNHOOKED_S) * passes
    host += speed.CPU_EP_LAYER_PASS_S * moe * (2 + frac) if ep > 1 else 0.0
    optimized = (CT.total if tuning is None else tuning.trainable) / 2
    step_host = speed.CPU_HOST_OPTIMIZER_STEP_S if stage == 3 else speed.CPU_HOST_OPTIMIZER_STEP_UNHOOKED_S
    return {
        "compute_s": ga * T * flops * (1 + frac * fwd) * 1.5 / (speed.CPU_COMPUTE_TFLOPS * 1e12),
        "layer_gpu_s": 0.0,
        "collectives_s": ga * collectives,
        "grad_copy_s": 0.0,
        "all_to_all_s": ga * a2a if ep > 1 else 0.0,
        "host_s": ga * 1.5 * host,
        "optimizer_s": optimized / 1e9 * speed.CPU_ADAM_CORE_S_PER_BPARAM_CPU * 2 / threads + 1.5 * step_host,
        "boundary_s": boundary,
    }


def _assert_terms(step: speed.StepTime, want: dict) -> None:
    got = {k: getattr(step, k) for k in want}
    assert got == {k: approx(v) for k, v in want.items()}


@pytest.mark.parametrize("stage", [3, 2, 1])
@pytest.mark.parametrize("ep", [1, 2])
def test_a_cpu_ranks_step_is_the_files_term_by_term(stage, ep):
    """Every term of a CPU rank's step, at each ZeRO stage and EP 1 and 2, with two thirds of the layers
    recomputed (3 layers, every second one checkpointed)."""
    frac = 2 / 3
    assert speed.checkpointed_fraction(TINY["num_hidden_layers"], 2) == frac
    step = _cpu_step(_cpu_cal(), ep=ep, stage=stage)
    _assert_terms(step, _cpu_terms(ep=ep, stage=stage, frac=frac))
    T = 2 * 128
    assert (step.tokens_per_step, step.flops_per_token, step.peak_tflops) == (3 * T, FT, 0.5)
    assert step.unknown == () and step.synchronous is True and step.bound == "host + device"
    assert step.step_s == approx(step.gpu_s + step.host_s + step.optimizer_s + step.boundary_s)


def test_a_cpu_step_without_recompute_and_with_lora():
    """No checkpointing: nothing recomputed. LoRA: its own FLOPs and forward share, only the trainable
    parameters reduced and stepped."""
    _assert_terms(_cpu_step(_cpu_cal(), ep=2, stage=3, ckpt_every=0), _cpu_terms(ep=2, stage=3, frac=0.0))
    t = adapters.tuning(
        ST, CT, targets=["attention", "routed_experts"], r=4, dropout=0.0, base_precision="bf16"
    )
    assert t.trainable < CT.total and t.forward_share(CT) != 1 / 3
    for stage in (3, 1):
        step = _cpu_step(_cpu_cal(), ep=1, stage=stage, tuning=t)
        _assert_terms(step, _cpu_terms(ep=1, stage=stage, frac=2 / 3, tuning=t))


def test_a_cpu_step_needs_the_gemm_probe_and_names_what_the_file_did_not_time():
    assert _cpu_step(None, ep=1, stage=3) is None
    assert _cpu_step(_cal(gpu="cpu", fabric="tcp", nodes=1, per_node=2), ep=1, stage=3) is None
    unmeasured = _cal(gpu="cpu", fabric="tcp", nodes=1, per_node=2, compute={"gemm_tflops": 0.5})
    step = _cpu_step(unmeasured, ep=2, stage=3)
    assert step.collectives_s == 0.0 and step.all_to_all_s == 0.0
    assert step.unknown == (
        "ZeRO-3 collectives across nodes (fabric bandwidth unknown)",
        "all-to-all across nodes (fabric bandwidth unknown)",
    )


def test_a_cpu_steps_sources_name_the_file_for_every_term():
    step = _cpu_step(_cpu_cal(), ep=2, stage=3)
    assert step.sources == (
        ("dense group (2 ranks inside a node)", MEASURED),
        ("ep group (2 ranks inside a node)", f"{MEASURED}: AutoEP's dispatch and combine"),
        ("compute", f"{scaled('cpu')} (x1.50)"),
        ("attention", fitted("cpu")),
        ("host", f"{scaled('cpu')} (x1.50)"),
        ("cpu_adam", f"{scaled('cpu')} (x2.00)"),
    )
    assert [n for n, _ in _cpu_step(_cpu_cal(), ep=1, stage=3).sources[:2]] == [
        "dense group (2 ranks inside a node)",
        "expert-dp group (2 ranks inside a node)",
    ]


# ---------------------------------------------------------------------------------------------------
# The plan from a file (dskit/plan/parallel.py `_speed_of`): the same rates and factors reach every
# candidate


def test_a_plan_from_a_file_uses_its_rates_and_its_probes(tmp_path):
    p = _with_probes(_file(tmp_path, cross_node_gbs=50), gemm_share=0.5, host=1.25)
    plan, found = _plan(f"hardware.calibration={p}")
    sources = found.chosen.speed.as_dict()["sources"]
    groups = {k: v for k, v in sources.items() if "group" in k}
    assert groups and all(v.startswith(MEASURED) for v in groups.values())
    assert {k: sources[k] for k in TERMS} == {
        "compute": f"{SCALED} (x2.00)",
        "attention": FITTED,
        "host": f"{SCALED} (x1.25)",
        "cpu_adam": FITTED,
    }
    base = {(r.candidate, r.speed.host_s) for r in _plan()[1].rows if r.speed}
    scaled_rows = {r.candidate: r.speed.host_s for r in found.rows if r.speed}
    assert base and all(scaled_rows[c] == approx(1.25 * h) for c, h in base)


def test_a_cpu_plan_from_a_file_predicts_with_its_gemm_rate(tmp_path):
    from dskit.plan.build import build_plan_searched
    from dskit.spec import load_spec

    p = _write(
        tmp_path, _data(CPU_RATES, gpu="cpu", fabric="tcp", nodes=1, per_node=2, compute={"gemm_tflops": 0.5})
    )
    hw = {"hardware.gpu": "cpu", "hardware.gpus_per_node": 2, "model.preset": "tiny-v2-experts"}
    sets = ["training.seq_len=128", "training.global_batch=8", f"hardware.calibration={p}"]
    plan, found = build_plan_searched(load_spec(None, sets, hw))
    assert plan.speed is not None and {r.speed.peak_tflops for r in found.rows} == {0.5}
