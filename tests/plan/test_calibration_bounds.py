"""Every number a calibration file holds is read within physical bounds (dskit/calibrate/calibration.py):
a value outside them is damage, refused in one line naming the field (exit 2), never a traceback from
the plan's arithmetic. Within them, the plan is made, whatever the value.

The fields are walked from a whole file (every numeric leaf: the hardware's sizes, each collective's fit
and timed points, the probes, CPU Adam), so a field added to the file is walked too."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from dskit.calibrate import calibration
from dskit.errors import SpecError
from dskit.plan.build import build_plan_searched
from dskit.spec import load_spec
from tests.plan.test_calibration_file import TWO_NODES, _file, refusal

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("DSKIT_PROPERTY_EXAMPLES", "400"))
FIELD = "hardware.calibration"
#: the plans that read every term: ZeRO-3 over two nodes, and with the optimizer offloaded (CPU Adam)
PLANS = ([], ["overrides.offload_optimizer=cpu", "overrides.zero_stage=3"])


def _whole(tmp: Path) -> Path:
    """A calibration of 2 x 8 H100 with every optional section present."""
    p = _file(tmp, cross_node_gbs=50.0)
    data = json.loads(p.read_text())
    data["compute"] = {"gemm_tflops": 600.0, "attention_tflops": 350.0, "host_layer_pass_s": 2e-4}
    data["cpu_adam"] = {"core_s_per_bparam": 2.4, "ranks": 8, "threads_per_rank": 4}
    p.write_text(json.dumps(data))
    return p


def _numbers(node: Any, path: tuple = ()) -> list[tuple]:
    """The path of every number in `node`."""
    if isinstance(node, bool):
        return []
    if isinstance(node, int | float):
        return [path]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [p for k, v in items for p in _numbers(v, (*path, k))]


def _with(data: dict, path: tuple, value: Any) -> dict:
    data = copy.deepcopy(data)
    node = data
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return data


def _plan_or_refusal(p: Path, sets: list[str]) -> SpecError | None:
    try:
        build_plan_searched(load_spec(None, [*TWO_NODES, *sets, f"{FIELD}={p}"], {}))
    except SpecError as e:
        return e
    return None


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, dict, list[tuple]]:
    p = _whole(tmp_path_factory.mktemp("cal"))
    data = json.loads(p.read_text())
    return p, data, _numbers(data)


def test_the_walk_reaches_every_section(whole):
    _, _, paths = whole
    tops = {p[0] for p in paths}
    assert tops == {"version", "hardware", "collectives", "compute", "cpu_adam"}
    assert ("compute", "host_layer_pass_s") in paths and ("cpu_adam", "core_s_per_bparam") in paths
    assert any(p[-1] == "latency_s" for p in paths) and any(p[-2:] == (0, 1) for p in paths)


# The findings (a ZeroDivisionError or "math domain error" traceback each), and the edges past
# each bound: each refused in one line that names the field.
@pytest.mark.parametrize(
    "path,value",
    [
        (("compute", "gemm_tflops"), 5e-324),
        (("compute", "host_layer_pass_s"), 1e308),
        (("cpu_adam", "core_s_per_bparam"), 5e-324),
        (("cpu_adam", "core_s_per_bparam"), 1e308),
        (("compute", "attention_tflops"), 1e-300),
        (("compute", "gemm_tflops"), 1e9),
        (("collectives", "all_gather", "1x2", "bus_gbs"), 5e-324),
        (("collectives", "all_gather", "1x2", "latency_s"), 1e308),
        (("collectives", "reduce_scatter", "8x1", "points", 0, 1), 0.0),
        (("collectives", "autoep_exchange", "8x1", "points", 0, 0), -1.0),
        (("hardware", "nodes"), 10**30),
    ],
)
def test_a_value_past_its_physical_bound_is_refused_in_one_line(tmp_path, whole, path, value):
    _, data, _ = whole
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps(_with(data, path, value)))
    line = refusal(tmp_path, p)
    assert f"damaged at {'.'.join(str(k) for k in path)}" in line, line


@pytest.mark.parametrize("probe", ["gemm_tflops", "attention_tflops"])
def test_a_gpu_rate_above_the_catalogs_peak_is_refused(tmp_path, whole, probe):
    """989 TFLOP/s is the H100's bf16 peak: a probe cannot read twice that, and may read up to
    PEAK_MARGIN over it (timing noise), that edge included."""
    _, data, _ = whole
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps(_with(data, ("compute", probe), 2000.0)))
    e = _plan_or_refusal(p, [])
    assert e is not None and e.field == FIELD, e
    assert f"damaged at compute.{probe}: 2000 TFLOP/s is above the h100-80gb bf16 peak (989, " in str(e), e
    for allowed in (989.0, 989.0 * calibration.PEAK_MARGIN):
        p.write_text(json.dumps(_with(data, ("compute", probe), allowed)))
        assert _plan_or_refusal(p, []) is None, allowed


def test_the_edges_inside_every_bound_make_a_plan(tmp_path, whole):
    """Each bound's own value is a reading the file may hold: the plan is made, with finite terms."""
    _, data, _ = whole
    edges = {
        "bus_gbs": calibration.BUS_GBS,
        "latency_s": (0.0, calibration.LATENCY_S),
        "gemm_tflops": (calibration.TFLOPS[0], 989.0),
        "attention_tflops": (calibration.TFLOPS[0], 989.0),
        "host_layer_pass_s": calibration.HOST_LAYER_S,
        "core_s_per_bparam": calibration.CPU_ADAM_S,
    }
    for path in _numbers(data):
        for value in edges.get(path[-1], ()):
            p = tmp_path / "calibration.json"
            p.write_text(json.dumps(_with(data, path, value)))
            for sets in PLANS:
                _, found = build_plan_searched(load_spec(None, [*TWO_NODES, *sets, f"{FIELD}={p}"], {}))
                step = found.chosen.speed.step_s
                assert math.isfinite(step) and step > 0, (path, value)


_NUMBERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=0, max_value=1e-300, allow_subnormal=True),
    st.floats(min_value=1e300, max_value=1.7e308),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 5e-324, 1e-6, 1e5, 1e4, 1e-7, 1.0, 10.0, 3600.0, 2.0**50, 1024, 100_000]),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_number_in_any_field_is_refused_in_one_line_or_planned(tmp_path, whole, data):
    """Generated values, one to three fields at once, on a plan that reads every term: a SpecError of one
    line naming the calibration, or a plan with a finite step time; never another exception."""
    _, base, paths = whole
    changed = base
    for path in data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3, unique=True)):
        changed = _with(changed, path, data.draw(_NUMBERS))
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps(changed))
    sets = data.draw(st.sampled_from(PLANS))
    try:
        _, found = build_plan_searched(load_spec(None, [*TWO_NODES, *sets, f"{FIELD}={p}"], {}))
    except SpecError as e:
        assert e.field == FIELD and "\n" not in str(e), str(e)
        return
    speed = found.chosen.speed
    assert speed is None or (math.isfinite(speed.step_s) and speed.step_s > 0)
