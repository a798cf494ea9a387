"""The communication model: each collective over its process group's shape (dskit/plan/links.py), and
ZeRO-3's prefetch limits chosen so the overlap the model counts is the one the config allows."""

from __future__ import annotations

import pytest

from dskit import catalog
from dskit.plan import links, prefetch, speed
from dskit.plan.build import build_plan
from dskit.plan.links import Group, Links
from dskit.plan.model_math import counts
from dskit.plan.shape import ModelShape
from dskit.spec import load_spec

H100 = catalog.gpu("h100-80gb")
IB = catalog.fabric("infiniband")
CATALOG = Links.of(H100, IB)


def test_groups_follow_autoeps_layout():
    """EP groups are consecutive ranks, expert-data-parallel ones stride by EP: on 32 nodes of 8,
    EP 8 keeps the all-to-all inside a node and puts one rank per node in each expert-DP group."""
    g = links.groups(world=256, per_node=8, ep_size=8)
    assert g["dense"] == Group(8, 32) and g["ep"] == Group(8, 1) and g["expert_dp"] == Group(1, 32)
    g = links.groups(world=256, per_node=8, ep_size=64)
    assert g["ep"] == Group(8, 8) and g["expert_dp"] == Group(1, 4)
    g = links.groups(world=256, per_node=8, ep_size=2)
    assert g["ep"] == Group(2, 1) and g["expert_dp"] == Group(4, 32)
    assert links.groups(world=2, per_node=8, ep_size=1)["dense"] == Group(2, 1)


def test_a_ring_across_nodes_runs_on_every_local_ranks_nic():
    """NCCL's ring bus bandwidth across nodes: each local rank of the group drives its own NIC share at
    the rate NCCL reaches per NIC (48 of the line's 50 GB/s), bounded by the node's link; one rank per
    node gets one NIC."""
    assert IB.bus_gbs_per_gpu == 48 < IB.gbs_per_gpu == 50
    assert CATALOG.rate("all_gather", Group(8, 32)).bus_gbs == min(450, 8 * 48)
    assert CATALOG.rate("reduce_scatter", Group(1, 32)).bus_gbs == 48
    assert CATALOG.rate("all_gather", Group(8, 1)).bus_gbs == 450


def test_ring_latency_counts_every_step_by_the_link_it_crosses():
    """NCCL's tuning model (tuning.cc): 8.4 us a call, 3.4 us per step over NVLink, 5.7 over PCIe, 9.6
    across the network. At 256 ranks on 32 nodes an all-gather's 255 steps are 224 inside nodes and 31
    across: 1.07 ms, most of it inside the nodes; an all-reduce runs the ring twice."""
    lat = CATALOG.rate("all_gather", Group(8, 32)).latency_s
    assert lat == pytest.approx((8.4 + 224 * 3.4 + 31 * 9.6) * 1e-6) and lat == pytest.approx(1.0676e-3)
    assert CATALOG.rate("all_reduce", Group(8, 32)).latency_s == pytest.approx(
        (8.4 + 448 * 3.4 + 62 * 9.6) * 1e-6
    )
    assert CATALOG.rate("all_gather", Group(8, 1)).latency_s == pytest.approx((8.4 + 7 * 3.4) * 1e-6)
    pcie = Links.of(catalog.gpu("l40s-48gb"), IB)
    assert pcie.rate("all_gather", Group(8, 1)).latency_s == pytest.approx((8.4 + 7 * 5.7) * 1e-6)
    # an all-to-all exchanges with every peer at once: one step
    assert CATALOG.rate("all_to_all", Group(8, 2)).latency_s == pytest.approx(9.6e-6)


def test_bytes_moved_are_ncclss_bus_bandwidth_factors():
    """nccl-tests' bus bandwidth: (g-1)/g of the tensor per rank for all-gather and reduce-scatter,
    2(g-1)/g for all-reduce, after the call's latency; one rank moves nothing."""
    g = Group(8, 1)
    gb = 1e9
    lat = {op: CATALOG.rate(op, g).latency_s for op in ("all_gather", "all_reduce")}
    assert CATALOG.seconds("all_gather", g, 450 * gb) == pytest.approx(lat["all_gather"] + 7 / 8)
    assert CATALOG.seconds("all_reduce", g, 450 * gb) == pytest.approx(lat["all_reduce"] + 2 * 7 / 8)
    assert CATALOG.seconds("all_gather", Group(1, 1), 1e12) == 0


def test_an_all_to_all_across_nodes_is_bound_by_the_nic_share():
    """EP 16 on nodes of 8: half of each rank's bytes leave the node on its own NIC (48 GB/s), the
    rest cross NVLink at the same time: the NIC sets the pace."""
    r = CATALOG.rate("all_to_all", Group(8, 2))
    sent = 15 / 16
    assert r.bus_gbs == pytest.approx(sent / (8 / 16 / 48))


def test_an_unknown_fabric_has_no_rate_across_nodes():
    tcp = Links.of(H100, catalog.fabric("tcp"))
    assert tcp.rate("all_gather", Group(8, 2)) is None and tcp.seconds("all_gather", Group(8, 2), 1) is None
    assert tcp.rate("all_gather", Group(8, 1)) is not None


def _v3(nodes: int, *sets: str):
    return build_plan(load_spec(None, [f"hardware.nodes={nodes}", "model.preset=deepseek-v3", *sets], {}))


def test_zero3_prefetches_what_the_rendered_limit_leaves_and_the_model_counts_the_rest():
    """At EP 8 a V3 layer's local experts exceed DeepSpeed's default live-parameter limit (1e9): the
    plan raises the limit to that layer plus one prefetch bucket, so one bucket of the next layer is
    fetched ahead while a layer is computed and the rest when it starts; the model's share is the
    config's. Where the default leaves room for a whole layer, all of it is fetched ahead."""
    plan = _v3(32, "overrides.zero_stage=3", "overrides.ep_size=8")
    z = plan.deepspeed["zero_optimization"]
    c = counts(ModelShape.from_config(plan.model.config), plan.parallel.seq_len)
    layer = prefetch.gathered_layer_params(c, plan.hardware.world_size, 8)
    assert layer > prefetch.MAX_LIVE_DEFAULT  # the case the default config could not prefetch at all
    assert z["stage3_max_live_parameters"] == layer + prefetch.PREFETCH_BUCKET
    share = prefetch.prefetched_share(z["stage3_max_live_parameters"], layer)
    assert share == pytest.approx(prefetch.PREFETCH_BUCKET / layer) and share < 0.05
    assert prefetch.prefetched_share(prefetch.MAX_LIVE_DEFAULT, layer) == 0.0
    assert speed.prefetched(c, speed.Layout(world=256, per_node=8, ep_size=8)) == share
    assert prefetch.prefetched_share(prefetch.MAX_LIVE_DEFAULT, 10**8) == 1.0


def test_a_moe_layer_is_prefetched_under_the_limit_the_largest_unit_sets():
    """At EP 256 no expert is gathered, and the largest gathered unit is the embedding (0.93 B): the
    rendered limit is DeepSpeed's 1e9, which leaves a MoE layer's 0.23 B room for the whole next layer,
    not the 8% it leaves beside the embedding."""
    plan = _v3(32, "overrides.zero_stage=3", "overrides.ep_size=256")
    c = counts(ModelShape.from_config(plan.model.config), plan.parallel.seq_len)
    largest = prefetch.gathered_layer_params(c, 256, 256)
    live = plan.deepspeed["zero_optimization"]["stage3_max_live_parameters"]
    assert largest == c.largest_layer > 3 * c.moe_layer_non_expert and live == prefetch.MAX_LIVE_DEFAULT
    assert prefetch.prefetched_share(live, largest) < 0.1
    assert speed.prefetched(c, speed.Layout(world=256, per_node=8, ep_size=256)) == 1.0


def test_zero3s_reduce_scatter_runs_behind_the_backward_whatever_the_live_limit():
    """DeepSpeed reduce-scatters ZeRO-3's gradients on its reduce stream as they come: the live limit
    holds back only the gathers. Nothing prefetched: the backward's gather is exposed whole, its
    reduce-scatter hidden by the backward's compute; all prefetched: both share that compute."""
    assert speed._exposed(1.0, 2.0, share=0.0, free=1.5) == pytest.approx(1.0)
    assert speed._exposed(1.0, 2.0, share=1.0, free=1.5) == pytest.approx(0.5)
    assert speed._exposed(0.0, 2.0, free=2.5) == pytest.approx(0.5)  # ZeRO-2's: the reduce-scatter alone


def test_a_gather_longer_than_the_compute_behind_it_is_exposed():
    """The prefetch term can fail: per pass, what the compute of that pass cannot hide is exposed, and
    what the live limit does not let start ahead is exposed whole."""
    windows = speed.compute_windows(0.3, 0.0, None)
    assert windows == pytest.approx((0.1, 0.2, 0.0))
    assert speed.compute_windows(0.4, 1.0, None) == pytest.approx((0.1, 0.2, 0.1))
    assert speed._exposed(0.05, 0.1) == 0.0  # hidden
    assert speed._exposed(0.3, 0.1) == pytest.approx(0.2)  # three times its window: two thirds exposed
    assert speed._exposed(0.3, 0.1, share=0.1) == pytest.approx(0.27)  # 0.03 ahead, hidden; 0.27 exposed


def test_small_models_keep_deepspeeds_defaults():
    """Where DeepSpeed's default leaves room to prefetch, the rendered config is what the one- and
    two-GPU runs were measured with."""
    plan = build_plan(load_spec(None, ["overrides.zero_stage=3", "hardware.gpus_per_node=2"], {}))
    assert plan.deepspeed["zero_optimization"]["stage3_max_live_parameters"] == prefetch.MAX_LIVE_DEFAULT


def test_ep_groups_that_would_straddle_nodes_unevenly_are_not_planned():
    """On nodes of 6, EP 4's consecutive groups would hold 4 ranks on one node and 2+2 across two: no
    single shape to time. The search leaves EP 4 out; pinned, it is refused naming the valid sizes."""
    from dskit.errors import SpecError
    from dskit.plan import search

    assert 4 not in search.ep_sizes(64, 12, 6) and {1, 2, 3, 6} <= set(search.ep_sizes(64 * 3, 12, 6))
    with pytest.raises(SpecError) as e:
        build_plan(
            load_spec(None, ["hardware.gpus_per_node=6", "hardware.nodes=2", "overrides.ep_size=4"], {})
        )
    assert e.value.field == "overrides.ep_size" and "straddle nodes unevenly" in e.value.message
