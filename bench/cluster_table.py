"""The plan at cluster scale, and DeepSeek-V3's communication terms worked from first principles (no GPU:
`dskit plan`'s own models only).

For DeepSeek-V2-Lite, V2 and V3 at 8, 64 and 256 GPUs (8 per node, InfiniBand) of H100 and H200, with
the default spec, it prints a markdown table and writes JSON (`--out`) with each model's pick, predicted
tokens/s/GPU and communication terms (collectives_s, all_to_all_s, boundary_s).

For DeepSeek-V3 on 32 x 8 H100 it then works each communication term of the pick by hand: the bytes a
rank moves per step in each process group (the dense ZeRO group, the expert-data-parallel group, the EP
all-to-all), NCCL's ring factor (g-1)/g, the bus rate, NCCL's ring latency per call, and the share
ZeRO-3's prefetch hides (each layer's gather against the compute it can run behind) - beside the step-time
model's own term for the same traffic (dskit/plan/speed.py's internals, and the plan's `speed`), with the
ratio model / arithmetic, flagged outside GOAL. It does this with the catalog's rates (no calibration),
and with a calibration file written here from NCCL's published achievable rates
(`published_calibration`), passed as `hardware.calibration` as a user's `dskit calibrate` output is;
where the calibration moves the pick, a third time with the catalog's pick held (overrides.*), so that
the same traffic is compared under both sets of rates.

    python bench/cluster_table.py --out bench/results/scale/model-cluster-table-2026-12-05.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: this checkout's dskit
    sys.path.insert(0, str(REPO))

from bench import runs  # noqa: E402

MODELS = ("deepseek-v2-lite", "deepseek-v2", "deepseek-v3")
GPUS = ("h100-80gb", "h200-141gb")
WORLDS = (8, 64, 256)
PER_NODE = 8
#: V3's catalog pick on 32 x 8 H100 when its terms were first audited (docs/planner.md "DeepSeek-V3 on
#: 32 x 8 H100, term by term"): EP 8 inside a node, whose all-to-all was 2.49x the line-rate arithmetic
#: under one share of the link (0.4) for AutoEP's whole exchange
AUDITED = {
    "zero_stage": 3,
    "ep_size": 8,
    "micro_batch": 4,
    "activation_checkpointing": 1,
    "offload_optimizer": "cpu",
}
FABRIC = "infiniband"
#: the worked example: DeepSeek-V3 on 32 x 8 H100
ARITH = ("deepseek-v3", "h100-80gb", 256)
#: how far the model's term may be from the first-principles arithmetic (the issue's goal)
GOAL = 0.30
COMM_TERMS = ("collectives_s", "all_to_all_s", "boundary_s")
GB = 1e9
US = 1e-6

# ---- NCCL's ring latency, by hand (NVIDIA/nccl src/graph/tuning.cc, protocol Simple: `baseLat` per
# call, `hwLat` per ring step by the link it crosses); the same constants links.py documents ----
NCCL_BASE_US = 8.4
NCCL_NVLINK_STEP_US = 3.4
NCCL_NET_STEP_US = 9.6

# ---- the published rates the calibration file is written from (`published_calibration`) ----
#: NCCL's achievable all_gather / reduce_scatter bus bandwidth over NVLink 4 on 8 H100: "360 GB/s is
#: exactly what we'd expect on H100" (NCCL maintainer sjeaugey, NVIDIA/nccl-tests issue #326,
#: 2025-06-24); "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective
#: NVLink bandwidth of 370GB/s" (same, NVIDIA/nccl-tests issue #212, 2024-05-06). A ring across nodes
#: also crosses NVLink inside every node, so it is the ceiling there too.
NVLINK_RING_GBS = 360.0
#: NCCL's rate per NDR 400 Gb/s NIC (one ConnectX-7 per GPU): 96% of the 50 GB/s line rate, NCCL's
#: maintainers' figure (NVIDIA/nccl-tests issue #119, the number fabrics.yaml `bus_gbs_per_gpu` cites);
#: "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (AddyLaddy, NVIDIA/nccl-tests issue #290).
#: A ring with r ranks per node leaves each node over r NICs (links.py).
NIC_BUS_GBS = 48.0
#: ASSUMPTION, no published figure: AutoEP's dispatch and combine (its count exchange, the split sizes
#: read back to the host, uneven splits) reach 0.8 of NCCL's rates, over NVLink (an all-to-all inside a
#: node taken at the ring's NVLINK_RING_GBS: no published H100 all-to-all figure is used) and over the
#: NICs. An
#: all-to-all across nodes is bound by its network share at one NIC per GPU: "Alltoall cannot aggregate
#: the bandwidth of multiple NICs" (sjeaugey, NVIDIA/nccl-tests issue #267); "the portion that's going
#: through the network will determine the global time" (sjeaugey, NVIDIA/nccl-tests issue #130).
EXCHANGE_SHARE = 0.8
#: ASSUMPTION: a dispatch-and-combine pair's fixed cost is three NCCL calls (the count exchange, the
#: dispatch, the combine), each NCCL's base latency plus one step over the link it crosses
EXCHANGE_CALLS = 3


def _sets(
    model: str, gpu: str, world: int, calibration: Path | None = None, extra: list[str] | None = None
) -> list[str]:
    sets = [
        f"model.preset={model}",
        f"hardware.gpu={gpu}",
        f"hardware.gpus_per_node={PER_NODE}",
        f"hardware.nodes={world // PER_NODE}",
        f"network.fabric={FABRIC}",
    ]
    if calibration is not None:
        sets.append(f"hardware.calibration={calibration}")
    return sets + (extra or [])


def _plan(
    model: str, gpu: str, world: int, calibration: Path | None = None, extra: list[str] | None = None
) -> Any:
    from dskit.plan.build import build_plan_searched
    from dskit.spec import load_spec

    return build_plan_searched(load_spec(None, _sets(model, gpu, world, calibration, extra), {}))[0]


def _pick_of(p: Any) -> str:
    ck = {0: "no ckpt", 1: "ckpt"}.get(p.activation_checkpointing, f"ckpt/{p.activation_checkpointing}")
    off = ", offload" if p.offload_optimizer else ""
    return f"ZeRO-{p.zero_stage} EP {p.ep_size} mb {p.micro_batch}x{p.grad_accum} {ck}{off}"


# ---- the table ----


def rows() -> list[dict[str, Any]]:
    """Every cell's pick and communication terms, with the catalog's rates."""
    from dskit.errors import SpecError

    out = []
    for model in MODELS:
        for gpu in GPUS:
            for world in WORLDS:
                row: dict[str, Any] = {"model": model, "gpu": gpu, "gpus": world}
                try:
                    plan = _plan(model, gpu, world)
                except SpecError as e:
                    row["refused"] = f"{e.field}: {e.message}".splitlines()[0]
                    out.append(row)
                    continue
                p, s = plan.parallel, plan.speed or {}
                row.update(
                    pick=_pick_of(p),
                    zero_stage=p.zero_stage,
                    ep_size=p.ep_size,
                    micro_batch=p.micro_batch,
                    grad_accum=p.grad_accum,
                    activation_checkpointing=p.activation_checkpointing,
                    offload_optimizer=p.offload_optimizer,
                    memory_gib=plan.memory["total_gib"],
                    tokens_per_s_per_gpu=s.get("tokens_per_s_per_gpu"),
                    step_s=s.get("step_s"),
                    **{k: s.get(k, 0.0) for k in COMM_TERMS},
                    sources=s.get("sources", {}),
                )
                out.append(row)
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    lines = [
        "| model | GPUs | pick | tok/s/GPU | collectives / a2a / boundary s |",
        "|---|---|---|---|---|",
    ]
    for r in table:
        gpus = f"{r['gpus']} x {r['gpu'].split('-')[0].upper()}"
        if "refused" in r:
            lines.append(f"| {r['model']} | {gpus} | does not fit | - | - |")
            continue
        comm = " / ".join(f"{r[k]:.2f}" for k in COMM_TERMS)
        lines.append(f"| {r['model']} | {gpus} | {r['pick']} | {r['tokens_per_s_per_gpu']:,} | {comm} |")
    return "\n".join(lines)


# ---- the calibration file from NCCL's published rates ----


def _ring_latency_us(g: Any) -> float:
    """NCCL's latency of one all-gather or reduce-scatter over a ring shaped `g`: the base per call, one
    NVLink step per step inside a node, one network step per step that crosses nodes (tuning.cc)."""
    steps, inter = g.size - 1, g.nodes - 1
    return NCCL_BASE_US + (steps - inter) * NCCL_NVLINK_STEP_US + inter * NCCL_NET_STEP_US


def _published_ring_gbs(g: Any) -> float:
    return NVLINK_RING_GBS if not g.spans_nodes else min(NVLINK_RING_GBS, g.ranks_per_node * NIC_BUS_GBS)


def _published_exchange_gbs(g: Any) -> float:
    """AutoEP's exchange over `g` at EXCHANGE_SHARE of NCCL's rates: inside a node NVLink's; across nodes
    the network share (g-r)/g at one NIC per GPU and the node share (r-1)/g over NVLink, both at once
    (the bus rate, as the calibration fits it, is bytes sent per second: (g-1)/g of the whole)."""
    nvlink, nic = EXCHANGE_SHARE * NVLINK_RING_GBS, EXCHANGE_SHARE * NIC_BUS_GBS
    if not g.spans_nodes:
        return nvlink
    net = (g.size - g.ranks_per_node) / g.size / nic
    node = (g.ranks_per_node - 1) / g.size / nvlink
    return (g.size - 1) / g.size / max(net, node)


def published_calibration(path: Path) -> dict[str, Any]:
    """Write a version-2 calibration for V3's cluster (32 x 8 H100, InfiniBand) from the published
    rates above, at the group shapes and sizes the plan's own calibration job would time
    (dskit/calibrate/measures.py `calibrate_plan`), plus the in-node 8x1 ring the rest derive from.
    Each fit's points lie on its line: latency + bytes x share / bus rate."""
    import dskit
    from dskit.calibrate import calibration
    from dskit.calibrate.calibration import Calibration
    from dskit.calibrate.job import exchange_bytes
    from dskit.plan.build import build_calibration_plan
    from dskit.plan.links import Group
    from dskit.spec import load_spec

    model, gpu, world = ARITH
    job = build_calibration_plan(load_spec(None, _sets(model, gpu, world), {}), "slurm").calibrate
    rings = {g.key: g.moved_share for g in job.groups}
    rings.setdefault("8x1", {op: 7 / 8 for op in calibration.RING_OPS})
    collectives: dict[str, dict[str, Any]] = {op: {} for op in calibration.OPS}
    for key, shares in rings.items():
        g = Group(*(int(x) for x in key.split("x")))
        bus, latency = _published_ring_gbs(g), _ring_latency_us(g) * US
        for op, share in shares.items():
            points = [(float(b), latency + b * share / (bus * GB)) for b in job.sizes_bytes]
            collectives[op][key] = {"bus_gbs": bus, "latency_s": latency, "points": points}
    for x in job.exchanges:
        g = Group(*(int(v) for v in x.key.split("x")))
        bus = _published_exchange_gbs(g)
        latency = (
            EXCHANGE_CALLS
            * (NCCL_BASE_US + (NCCL_NET_STEP_US if g.spans_nodes else NCCL_NVLINK_STEP_US))
            * US
        )
        share = (x.ep_size - 1) / x.ep_size
        points = [
            (float(b), latency + b * share / (bus * GB)) for b in (exchange_bytes(x, t) for t in x.tokens)
        ]
        collectives[calibration.EXCHANGE][x.key] = {"bus_gbs": bus, "latency_s": latency, "points": points}
    data = {
        "version": calibration.VERSION,
        "dskit": dskit.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": {
            "gpu": gpu,
            "fabric": FABRIC,
            "nodes": world // PER_NODE,
            "procs_per_node": PER_NODE,
            "device": "NVIDIA H100 80GB HBM3",
            "backend": "nccl",
            "torch": "none: written by bench/cluster_table.py from NCCL's published rates",
            "nccl": None,
            "driver": None,
        },
        "collectives": collectives,
        # no probes: the fitted compute, host and CPU Adam terms stay unscaled, so only the rates move
        "compute": {},
        "warnings": [],
    }
    calibration.write(path, Calibration.model_validate(data))
    calibration.read(path)  # the plan's own reader accepts it
    return data


# ---- DeepSeek-V3 on 32 x 8 H100, term by term ----


def _term(term: str, group: str, arithmetic: str, fp: float, model: float, note: str) -> dict[str, Any]:
    # both nothing (a one-rank group) agree; the model something where the arithmetic has nothing: no ratio
    ratio = model / fp if fp else (1.0 if not model else None)
    return {
        "term": term,
        "group": group,
        "arithmetic": arithmetic,
        "first_principles_s": round(fp, 4),
        "model_s": round(model, 4),
        "ratio": None if ratio is None else round(ratio, 3),
        "within_goal": ratio is not None and abs(ratio - 1) <= GOAL,
        "model_note": note,
    }


def terms(
    calibration_path: Path | None, pin: dict[str, Any] | None = None, held: str = "the catalog pick held"
) -> dict[str, Any]:
    """V3 on 32 x 8 H100 (ARITH): each communication term of the pick from first principles beside the
    model's, with the catalog's rates (None) or the calibration at `calibration_path`; `pin`: a pick to
    hold (overrides.*), else the plan's own, `held` saying which."""
    from dskit import catalog
    from dskit.calibrate import calibration, scales
    from dskit.plan import links as links_
    from dskit.plan import speed
    from dskit.plan.model_math import counts
    from dskit.plan.prefetch import gathered_layer_params, max_live, prefetched_share
    from dskit.plan.shape import ModelShape

    model, gpu_name, world = ARITH
    extra = [f"overrides.{k}={v}" for k, v in (pin or {}).items()]
    plan = _plan(model, gpu_name, world, calibration_path, extra)
    p, s = plan.parallel, plan.speed
    if p.zero_stage != 3:  # the arithmetic below is ZeRO-3's (per-layer gathers)
        raise SystemExit(f"{model} on {world} {gpu_name}: the pick is ZeRO-{p.zero_stage}, not ZeRO-3")
    cfg = plan.model.config
    shape = ModelShape.from_config(cfg)
    c = counts(shape, p.seq_len)
    gpu, fabric = catalog.gpu(gpu_name), catalog.fabric(FABRIC)
    cal = None if calibration_path is None else calibration.read(calibration_path)
    rates = links_.Links.of(gpu, fabric, cal)
    layout = speed.Layout(world, PER_NODE, p.ep_size)
    shapes = links_.groups(world, PER_NODE, p.ep_size)
    L, moe, dense_n = cfg["num_hidden_layers"], c.moe_layers, c.dense_layers
    frac = speed.checkpointed_fraction(L, p.activation_checkpointing)
    accum, tokens = p.grad_accum, p.micro_batch * p.seq_len
    h, k, V = cfg["hidden_size"], cfg["num_experts_per_tok"], cfg["vocab_size"]
    W = speed.WIRE_BYTES  # bf16 weights, gradients and routed activations on the wire

    # parameters, counted from the config (model_math.counts): what each group moves
    experts = c.experts_per_layer * moe
    non_expert = c.total - experts  # sharded over every rank (the dense group)
    vocab = V * h  # the embedding; the head is as large (not tied in V3)
    outer = vocab * (1 if cfg.get("tie_word_embeddings") else 2) + h  # embedding, head, final norm
    in_layers = non_expert - outer  # every layer's attention, norms, dense MLPs, shared experts, routers
    local = experts / p.ep_size  # this rank's EP shard, sharded over the expert-data-parallel group
    dense_layer = (in_layers - moe * c.moe_layer_non_expert) / max(1, dense_n)
    # a layer's parameters in each group (a one-rank group gathers nothing: the whole tensor is there)
    sharded = shapes["expert_dp"].size > 1
    layer_params = {
        "dense": {"moe": c.moe_layer_non_expert, "dense": dense_layer},
        "expert_dp": {"moe": c.experts_per_layer / p.ep_size, "dense": 0.0},
    }

    def ring(g: Any) -> tuple[float, str, float, str]:
        """(bus GB/s, where from, latency s per call, where from) of a ring over `g`, by hand."""
        if cal is not None and g.key in cal.collectives.get("all_gather", {}):
            fit = cal.collectives["all_gather"][g.key]
            lat = f"{fit.latency_s * 1e6:.1f} us (the file's)"
            return fit.bus_gbs, f"{fit.bus_gbs:g} GB/s (the file's {g.key} ring)", fit.latency_s, lat
        nvlink, nic = gpu.interconnect_gbs, fabric.bus_gbs_per_gpu
        steps, inter = g.size - 1, g.nodes - 1
        lat = f"({NCCL_BASE_US:g} + {steps - inter} x {NCCL_NVLINK_STEP_US:g}" + (
            f" + {inter} x {NCCL_NET_STEP_US:g}" if inter else ""
        )
        lat = f"{lat} = {_ring_latency_us(g):.1f} us)"
        if not g.spans_nodes:
            return nvlink, f"NVLink {nvlink:g} GB/s", _ring_latency_us(g) * US, lat
        bus = min(nvlink, g.ranks_per_node * nic)
        how = f"min(NVLink {nvlink:g}, {g.ranks_per_node} x NIC {nic:g}) = {bus:g} GB/s"
        return bus, how, _ring_latency_us(g) * US, lat

    # ---- 1, 2: each ZeRO-3 group's traffic per step, before anything hides it ----
    # per micro-step: a gather per layer in the forward, the backward and the recomputed forward (the
    # embedding and head are gathered in the forward and backward, not recomputed), and one gradient
    # reduce-scatter; one NCCL call per layer and pass (DeepSpeed issues one per fetched module,
    # partitioned_param_coordinator.py, so the latency here is a lower bound, as the model's is)
    layers = {"dense": L, "expert_dp": moe}
    gathered = {"dense": 2 * non_expert + frac * in_layers, "expert_dp": (2 + frac) * local}
    reduced = {"dense": non_expert, "expert_dp": local}
    # the model's own bytes (speed._zero_groups: tensors under the persistence threshold not gathered) at
    # the model's rates (links.seconds), composed as speed._collectives_s composes them
    zero = {name: (gb, rb) for gb, rb, name in speed._zero_groups(shape, c, layout, None)}
    out = []
    transfer = {}
    one_layer: dict[str, dict[str, float]] = {}  # a layer's gather (= its reduce-scatter) per group, s
    for name, label in (("dense", "dense ZeRO group"), ("expert_dp", "expert-data-parallel ZeRO group")):
        g = shapes[name]
        gb, rb = zero[name]
        n = layers[name]
        modelled = accum * (
            2 * (rates.seconds("all_gather", g, gb, n) or 0.0)
            + ((rates.seconds("all_gather", g, gb * frac, n * frac) or 0.0) if frac else 0.0)
            + (rates.seconds("reduce_scatter", g, rb, n) or 0.0)
        )
        params = non_expert if name == "dense" else local
        if g.size == 1:  # nothing to gather or reduce: every rank holds these parameters whole
            one_layer[name] = {"moe": 0.0, "dense": 0.0}
            transfer[name] = 0.0
            out.append(
                _term(
                    f"ZeRO-3 {label}: gathers + reduce-scatter",
                    g.describe(),
                    f"one rank: its {params / 1e9:.2f} B parameters are whole on it, nothing moves",
                    0.0,
                    modelled,
                    "links.seconds: a group of one rank moves nothing",
                )
            )
            continue
        share = (g.size - 1) / g.size
        bus, bus_how, lat, lat_how = ring(g)
        calls = n * (2 + frac) + n  # gathers (forward, backward, recompute) + reduce-scatter
        nbytes = accum * W * (gathered[name] + reduced[name])
        fp = nbytes * share / (bus * GB) + accum * calls * lat
        transfer[name] = fp
        passes = (
            f"({2 + frac:g} x {params / 1e9:.2f} B - {frac:g} x {outer / 1e9:.2f} B embedding and head not"
            f" recomputed + 1 x {params / 1e9:.2f} B reduce-scatter)"
            if name == "dense"
            else f"({2 + frac:g} gathers + 1 reduce-scatter) x {params / 1e9:.2f} B"
        )
        out.append(
            _term(
                f"ZeRO-3 {label}: gathers + reduce-scatter",
                g.describe(),
                f"2 B x {passes} x {accum} micro-step(s) = {nbytes / GB:.1f} GB; x ({g.size - 1}/{g.size})"
                f" / {bus_how} = {nbytes * share / (bus * GB):.3f} s; + {accum * calls:g} calls x {lat_how}"
                f" = {accum * calls * lat:.3f} s",
                fp,
                modelled,
                "speed._zero_groups' bytes at links.seconds (bus rate and NCCL ring latency of the group's "
                "shape), before any overlap",
            )
        )
        one_layer[name] = {
            kind: (W * n_ * share / (bus * GB) + lat if n_ else 0.0)
            for kind, n_ in layer_params[name].items()
        }

    # ---- 3: what ZeRO-3's prefetch hides, layer by layer ----
    # DeepSpeed prefetches the next modules while fewer than stage3_max_live_parameters are gathered
    # (prefetch.py): beside a layer being computed, the rendered live limit leaves (live - that layer) for
    # the next one, so that share of the next layer's gather can run behind this layer's compute (if the
    # compute is long enough); the rest starts when its layer does, exposed. Runs of like layers (3 dense,
    # then 58 MoE) are taken as each prefetching its own kind. A layer's reduce-scatter runs on DeepSpeed's
    # reduce stream (stage3.py reduce_and_partition_stream; overlap_comm is on in the rendered config),
    # behind the backward compute that follows its gradients: room there after the prefetched gather;
    # the first layer's, and the embedding's, come last, with nothing left to hide them.
    zo = plan.deepspeed["zero_optimization"]
    live, bucket = zo["stage3_max_live_parameters"], zo["stage3_prefetch_bucket_size"]
    fl = speed._scaled_flops(c, plan.model.flops_per_token, scales.factors(cal, "gpu"))
    compute = speed._compute_s(
        tokens, fl, frac, plan.hardware.peak_tflops * 1e12, p.compile_regions, None, False
    )
    windows = speed.compute_windows(compute, frac, None)
    fwd_w, bwd_w = windows[0] / L, windows[1] / L  # one layer's share of its pass (layers taken as equal)
    gathered_layer = {
        kind: layer_params["dense"][kind] + (layer_params["expert_dp"][kind] if sharded else 0.0)
        for kind in ("moe", "dense")
    }
    ahead = {kind: max(0.0, min(1.0, (live - n_) / n_)) if n_ else 1.0 for kind, n_ in gathered_layer.items()}
    gather = {kind: one_layer["dense"][kind] + one_layer["expert_dp"][kind] for kind in ("moe", "dense")}
    count = {"moe": moe, "dense": dense_n}
    exposed = 0.0
    reduce_left = {}
    for kind in ("moe", "dense"):
        gth, a = gather[kind], ahead[kind]
        fwd = gth - min(a * gth, fwd_w)
        bwd = gth - min(a * gth, bwd_w)
        reduce_left[kind] = max(0.0, gth - max(0.0, bwd_w - min(a * gth, bwd_w)))
        exposed += count[kind] * ((1 + frac) * fwd + bwd + reduce_left[kind])  # fwd, recomputed fwd, bwd
    first = "dense" if dense_n else "moe"
    exposed += gather[first] - reduce_left[first]  # the first layer's reduce-scatter: nothing after it
    d = shapes["dense"]
    vocab_s = W * vocab * (d.size - 1) / d.size / (ring(d)[0] * GB) if d.size > 1 else 0.0
    # the embedding and head (inside the first and last layers' calls): the embedding's forward gather and
    # the head's backward one start a pass with nothing before them; the head's forward gather follows the
    # last layer, the embedding's backward one the first, with what the live limit leaves beside those
    last = "moe" if moe else "dense"
    follows = sum(
        min(max(0.0, min(1.0, (live - gathered_layer[kind]) / vocab)) * vocab_s, fwd_w)
        for kind in (last, first)
    )
    exposed += 4 * vocab_s - follows + vocab_s  # + the embedding's reduce-scatter, the backward's last
    exposed *= accum
    whole = sum(transfer.values())
    groups = speed._zero_groups(shape, c, layout, None)
    # the model's prefetched share (speed.prefetched): the live limit the largest gathered unit sets
    # (prefetch.gathered_layer_params, max_live), and the share of a MoE layer's gathered parameters it
    # leaves room for beside the layer being computed, taken for every layer and pass
    largest_model = gathered_layer_params(c, world, p.ep_size)
    live_model = max_live(largest_model)
    unit_model = (
        c.moe_layer_non_expert + (c.experts_per_layer // p.ep_size if sharded else 0)
        if moe
        else c.largest_layer
    )
    share_model = prefetched_share(live_model, unit_model)
    passes = speed.Passes(L, moe, frac)  # the layers each group holds: `layers` above
    model_exposed = (
        accum * speed._collectives_s(groups, shapes, rates, 3, passes, windows, share_model, [])[0]
    )
    model_whole = sum(t["model_s"] for t in out)
    # the same, piece by piece: each pass's gathers (both groups) with `share_model` of them free to start
    # ahead behind that pass's compute, and the backward's reduce-scatters (DeepSpeed's reduce stream,
    # overlap_comm) behind the backward's compute whole, in the room its prefetched gathers leave
    model_pass = [0.0, 0.0, 0.0]  # gathers: forward, backward, recompute (one micro-step)
    model_rs = 0.0  # reduce-scatters (one micro-step)
    for name, (gb, rb) in zero.items():
        g, n = shapes[name], layers[name]
        gth = rates.seconds("all_gather", g, gb, n) or 0.0
        model_pass[0] += gth
        model_pass[1] += gth
        model_pass[2] += (rates.seconds("all_gather", g, gb * frac, n * frac) or 0.0) if frac else 0.0
        model_rs += rates.seconds("reduce_scatter", g, rb, n) or 0.0
    ahead_pass = [share_model * x for x in model_pass]
    gathers_exposed = sum(x - min(a, w) for x, a, w in zip(model_pass, ahead_pass, windows, strict=True))
    room = max(0.0, windows[1] - ahead_pass[1])  # the backward's compute beside its prefetched gathers
    rs_exposed = max(0.0, model_rs - room)
    model_reduce, model_reduce_exposed = accum * model_rs, accum * rs_exposed
    model_pieces = accum * (gathers_exposed + rs_exposed)
    m, a = gather["moe"], ahead["moe"]
    out.append(
        _term(
            "ZeRO-3 exposed after prefetch (both groups)",
            "dense + expert-data-parallel",
            f"a MoE layer gathers {gathered_layer['moe'] / 1e9:.3f} B params in {m * 1e3:.1f} ms"
            f" ({one_layer['dense']['moe'] * 1e3:.1f} dense + {one_layer['expert_dp']['moe'] * 1e3:.1f} expert);"
            f" the live limit {live:.4g} leaves {max(0.0, live - gathered_layer['moe']):.3g} params beside it"
            f" (prefetch bucket {bucket:.3g}): {a:.1%} of the next one ({a * m * 1e3:.1f} ms) runs behind its"
            f" compute ({fwd_w * 1e3:.0f} ms forward, {bwd_w * 1e3:.0f} ms backward), the rest is exposed; its"
            f" reduce-scatter ({m * 1e3:.1f} ms) runs behind the backward's remaining"
            f" {max(0.0, bwd_w - min(a * m, bwd_w)) * 1e3:.0f} ms: {reduce_left['moe'] * 1e3:.1f} ms exposed."
            f" {moe} MoE + {dense_n} dense layers (a dense layer {gathered_layer['dense'] / 1e9:.3f} B,"
            f" {ahead['dense']:.0%} ahead), the embedding and head, x {2 + frac:g} passes x {accum} micro-step(s):"
            f" {1 - exposed / whole if whole else 1:.1%} of {whole:.2f} s hidden",
            exposed,
            model_exposed,
            f"speed._collectives_s without its fitted sync: each pass's gathers behind that pass's compute"
            f" ({windows[0] * accum:.2f} s forward, {windows[1] * accum:.2f} s backward,"
            f" {windows[2] * accum:.2f} s recomputed), of which only the prefetched share {share_model:.1%}"
            f" may start ahead, for every layer (speed.prefetched: (live {live_model:.4g} -"
            f" {unit_model:.4g}) / {unit_model:.4g}, a MoE layer's gathered parameters under the live limit"
            f" the largest gathered unit, {largest_model:.4g}, sets): {accum * gathers_exposed:.2f} s of"
            f" {accum * sum(model_pass):.2f} s exposed; the backward's reduce-scatters ({model_reduce:.2f} s)"
            f" on DeepSpeed's reduce stream, whole, in the {accum * room:.2f} s of backward compute its"
            f" prefetched gathers leave: {model_reduce_exposed:.2f} s exposed."
            f" {1 - model_exposed / model_whole:.1%} of {model_whole:.2f} s hidden",
        )
    )
    out[-1]["model_reduce_scatter_s"] = round(model_reduce, 4)
    out[-1]["model_reduce_scatter_exposed_s"] = round(model_reduce_exposed, 4)
    sync = accum * speed.SYNC_LAYER_PASS_S * L * (2 + frac)
    out.append(
        _term(
            "collectives_s (exposed + synchronisation)",
            "dense + expert-data-parallel",
            f"{exposed:.3f} s exposed + {speed.SYNC_LAYER_PASS_S * 1e3:g} ms x {L * (2 + frac):g} layer passes"
            f" x {accum} (SYNC_LAYER_PASS_S, fitted: not derived here) = {exposed + sync:.3f} s",
            exposed + sync,
            s["collectives_s"],
            "the plan's speed.collectives_s",
        )
    )

    # ---- 4: AutoEP's all-to-all ----
    ep = shapes["ep"]
    pairs = moe * (2 + frac)  # a dispatch and a combine per MoE layer and pass
    nbytes = accum * pairs * 2 * tokens * k * h * W
    sent = nbytes * (ep.size - 1) / ep.size
    net = nbytes * (ep.size - ep.ranks_per_node) / ep.size
    node = nbytes * (ep.ranks_per_node - 1) / ep.size
    measured = None if cal is None else cal.collectives.get(calibration.EXCHANGE, {}).get(ep.key)
    head = (
        f"{tokens} tokens x k {k} x hidden {h} x 2 B x 2 (dispatch, combine) x {pairs:g} pairs ({moe} MoE"
        f" layers x {2 + frac:g} passes) x {accum} micro-step(s) = {nbytes / GB:.1f} GB; x"
        f" ({ep.size - 1}/{ep.size}) sent = {sent / GB:.1f} GB"
    )
    if ep.size == 1:
        fp, how = 0.0, "EP 1: no exchange"
    elif measured is not None:
        fp = sent / (measured.bus_gbs * GB) + accum * pairs * measured.latency_s
        how = (
            f"{head} / {measured.bus_gbs:.4g} GB/s (the file's {ep.key} exchange) + {accum * pairs:g} pairs x"
            f" {measured.latency_s * 1e6:.1f} us"
        )
    else:
        nvlink, nic = gpu.interconnect_gbs, fabric.bus_gbs_per_gpu
        lat = NCCL_BASE_US + (NCCL_NET_STEP_US if ep.spans_nodes else NCCL_NVLINK_STEP_US)
        fixed = accum * pairs * speed.A2A_PAIR_FIXED_S
        fp = max(net / (nic * GB), node / (nvlink * GB)) + accum * pairs * 2 * lat * US + fixed
        how = (
            f"{head}: {net / GB:.1f} GB over the NICs at {nic:g} GB/s and {node / GB:.1f} GB over NVLink at"
            f" {nvlink:g} GB/s, at once; + {2 * accum * pairs:g} calls x ({NCCL_BASE_US:g} base + 1 step)"
            f" = {lat:.1f} us; + {accum * pairs:g} pairs x {speed.A2A_PAIR_FIXED_S * 1e3:g} ms"
            f" (A2A_PAIR_FIXED_S, fitted: not derived here) = {fixed:.3f} s"
        )
    a2a_model = accum * speed._all_to_all_s(shape, ep, rates, tokens, frac, [])
    note = (
        "the measured exchange as it is (links.exchange), no A2A_PAIR_FIXED_S"
        if measured is not None
        else f"the catalog rate, NVLink at A2A_LINK_SHARE = {links_.A2A_LINK_SHARE} of its line rate (NCCL's"
        f" reach), + A2A_PAIR_FIXED_S per pair (fitted on 2 x H200, EP 2 beside EP 1)"
    )
    out.append(
        _term("AutoEP all-to-all (dispatch + combine)", ep.describe(), how, fp, s["all_to_all_s"], note)
    )

    # the model's pieces recomposed must be the plan's own terms, or the comparison above is not of them
    check = {
        "collectives_s": (model_exposed + sync, s["collectives_s"]),
        "collectives_s by piece": (model_pieces + sync, s["collectives_s"]),
        "prefetched share": (share_model, speed.prefetched(c, layout)),
        "live limit": (live_model, live),
        "all_to_all_s": (a2a_model, s["all_to_all_s"]),
    }
    for key, (mine, plans) in check.items():
        if abs(mine - plans) > 1e-3 * max(1.0, plans):
            raise SystemExit(
                f"{key}: speed's internals give {mine:.4f}, the plan {plans}: this script is stale"
            )
    return {
        "case": f"{model} on {world // PER_NODE} x {PER_NODE} {gpu_name}, {FABRIC}",
        "calibration": None if cal is None else "NCCL's published rates (published_calibration)",
        "pinned": pin,
        "held": held if pin else None,
        "pick": _pick_of(p),
        # the pick as overrides, to hold it under another calibration
        "as_overrides": {
            "zero_stage": p.zero_stage,
            "ep_size": p.ep_size,
            "micro_batch": p.micro_batch,
            "activation_checkpointing": p.activation_checkpointing,
            "offload_optimizer": "cpu" if p.offload_optimizer else "none",
        },
        "tokens_per_s_per_gpu": s["tokens_per_s_per_gpu"],
        "step_s": s["step_s"],
        "sources": s.get("sources", {}),
        "non_expert_params_b": round(non_expert / 1e9, 3),
        "expert_params_b": round(experts / 1e9, 3),
        "local_expert_params_b": round(local / 1e9, 3),
        "groups": {name: g.describe() for name, g in shapes.items()},
        "prefetched_share": {
            "arithmetic_moe_layer": round(ahead["moe"], 4),
            "arithmetic_dense_layer": round(ahead["dense"], 4),
            "model_every_layer": round(share_model, 4),
        },
        "terms": out,
        "outside_goal": [t["term"] for t in out if not t["within_goal"]],
        "goal": GOAL,
    }


def terms_markdown(a: dict[str, Any]) -> str:
    lines = [
        f"{a['case']}, {'calibrated: ' + a['calibration'] if a['calibration'] else 'catalog rates'}: "
        f"{a['held'] if a['pinned'] else 'pick'} {a['pick']}, {a['tokens_per_s_per_gpu']:,} tokens/s/GPU; {a['non_expert_params_b']} B non-expert "
        f"parameters, {a['expert_params_b']} B routed-expert ({a['local_expert_params_b']} B per EP rank)",
        "",
        "| term | group | first principles | s | model s | model / arithmetic |",
        "|---|---|---|---|---|---|",
    ]
    for t in a["terms"]:
        flag = "" if t["within_goal"] else f" (outside {a['goal']:.0%})"
        ratio = (
            "-"
            if t["ratio"] is None or not (t["first_principles_s"] or t["model_s"])
            else f"{t['ratio']:.2f}"
        )
        lines.append(
            f"| {t['term']} | {t['group']} | {t['arithmetic']} | {t['first_principles_s']:.3f} "
            f"| {t['model_s']:.3f} | {ratio}{flag} |"
        )
    return "\n".join(lines)


def _commit() -> dict[str, Any]:
    """This checkout's commit, and what of the code it ran is not committed."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()

    dirty = [line[3:] for line in git("status", "--porcelain").splitlines() if line[3:].startswith("dskit/")]
    return {"commit": git("rev-parse", "--short", "HEAD"), "uncommitted_dskit": dirty}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="JSON file to write")
    a = ap.parse_args()

    table = rows()
    with tempfile.TemporaryDirectory(prefix="dskit-cluster-table-") as tmp:
        path = Path(tmp) / "calibration.json"
        cal = published_calibration(path)
        cases = {"catalog": terms(None), "calibrated": terms(path)}
        if cases["catalog"]["as_overrides"] != AUDITED:  # the EP 8 all-to-all the audit found 2.49x, again
            cases["catalog_audited_pick"] = terms(None, AUDITED, "the pick audited on 2026-12-05 held")
        # where the calibration moves the pick, the catalog's pick held too: the same traffic, both rates
        held = cases["catalog"]["as_overrides"]
        if cases["calibrated"]["as_overrides"] != held:
            cases["calibrated_catalog_pick"] = terms(path, held)
    print(markdown(table))
    for case in cases.values():
        print()
        print(terms_markdown(case))
    if a.out:
        head = {
            **runs.model_header(),
            **_commit(),
            "per_node": PER_NODE,
            "fabric": FABRIC,
        }
        a.out.write_text(
            json.dumps(
                {
                    **head,
                    "rows": table,
                    "markdown": markdown(table),
                    "published_calibration": cal,
                    "v3_terms": cases,
                    "v3_markdown": {name: terms_markdown(case) for name, case in cases.items()},
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
