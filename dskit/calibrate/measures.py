"""What a calibration job measures (`dskit calibrate`): decided here from the plan, so the job itself
(dskit/calibrate/job.py) only times what run.yaml lists.

It times the process groups a plan of this size forms, for every EP size the search weighs (not only
the pick's: the pick may change once the rates are measured): all-gather and reduce-scatter over the
dense group (every rank) and each EP size's expert-data-parallel group, at sizes spread around a
layer's gathered weights so the fitted latency and bandwidth hold where the plan uses them; and
AutoEP's own dispatch and combine over each EP size's expert-parallel group, at the token counts the
candidates route (`_exchange_tokens`). Groups of one shape are timed once, all of them at the same
moment, as a training step runs them.
"""

from __future__ import annotations

import math
from pathlib import Path

from dskit.catalog import GPU, Fabric
from dskit.launch.contract import CALIBRATION_FILE
from dskit.plan import links, search
from dskit.plan.host_memory import threads_per_rank
from dskit.plan.model_math import ModelCounts
from dskit.plan.prefetch import gathered_layer_params
from dskit.plan.schema import CalibrateExchange, CalibrateGroup, CalibratePlan, Plan
from dskit.plan.shape import ModelShape

#: sizes per op: few enough for a short job, spread enough to separate latency from bandwidth
SIZES = 4
#: ring sizes timed, bytes: on GPUs from MIN_BYTES_GPU to a layer's gathered weights within
#: [MIN_TOP_GPU, MAX_BYTES_GPU] (AutoEP's exchange is timed at its own token counts); the cpu profile (gloo,
#: the test clusters) a fixed small range, where bandwidth still dominates latency
MIN_BYTES_GPU, MIN_TOP_GPU, MAX_BYTES_GPU = 2**20, 64 * 2**20, 2 * 2**30
CPU_BYTES = (256 * 2**10, 8 * 2**20)
ITERS_GPU, ITERS_CPU = 5, 3
#: parameters each rank's CPU Adam steps (every rank of a node at once): long enough to time, short
#: enough not to matter
CPU_ADAM_PARAMS_GPU, CPU_ADAM_PARAMS_CPU = 200_000_000, 4_000_000
WIRE_BYTES = 2
#: the GPU probes' shapes, fixed so that every cluster's reading compares with the reference's
#: (dskit/calibrate/scales.py): V2-Lite's expert GEMM and attention at 2 x 4096 tokens, where the
#: reference was read. A probe at each plan's own shape would compare shapes, not hardware: one H200
#: ran 234 to 819 TFLOP/s over the presets' shapes.
PROBE_GEMM = (8192, 2048, 1408)
#: the cpu profile's GEMM probe (bf16, as CPU ranks train): small enough for a 2-core host, large enough
#: to time; compared with the CPU reference machine's reading (dskit/calibrate/scales.py)
PROBE_GEMM_CPU = (1024, 512, 512)
PROBE_ATTENTION = (2, 16, 4096, 192, 128)


def job_name(name: str, suffix: str) -> str:
    """`NAME-SUFFIX` within the spec's 52 characters (NAME cut, never the suffix)."""
    return f"{name[: 52 - len(suffix) - 1].rstrip('-')}-{suffix}"


def calibration_suffix(job: str) -> str:
    """What job_name added to the run's name to name its calibration job `job`: '-calibrate...'."""
    return job[job.rindex("-calibrate") :]


def calibration_name(name: str, target: str) -> str:
    """The one name of a calibration of the run NAME on `target` (local, slurm, ...): its run dir
    (runs/NAME-calibrate-TARGET), its storage dirs, calibration.json's among them, and its job. Its
    own, so it writes none of the training run's files; per target, so a calibration here never
    replaces a cluster's on storage they share."""
    return job_name(name, f"calibrate-{target}")


def calibrate_plan(
    plan: Plan, shape: ModelShape, counts: ModelCounts, gpu: GPU, fabric: Fabric, cpus_per_node: int | None
) -> Plan:
    """`plan` (of the model `shape`, `counts`) with the calibration job's section: what to time, at
    which sizes, where to write."""
    h, p = plan.hardware, plan.parallel
    world, per_node = h.world_size, h.procs_per_node
    rates = links.Links.of(gpu, fabric)
    shapes: dict[str, CalibrateGroup] = {}

    def add(g: links.Group, role: str, stride: int, ops: tuple[str, ...]) -> None:
        if g.size == 1:
            return
        had = shapes.get(g.key)
        ops = tuple(dict.fromkeys((*(had.moved_share if had else ()), *ops)))
        expected = {}
        for op in ops:
            r = rates.catalog_rate(op, g)
            expected[op] = None if r is None else round(r.bus_gbs, 3)
        shapes[g.key] = CalibrateGroup(
            key=g.key,
            role=had.role if had else role,
            size=g.size,
            stride=had.stride if had else stride,
            moved_share={op: links.moved_share(op, g.size) for op in ops},
            expected_gbs=expected,
        )

    on_gpu = h.on_gpu
    zero = ("all_gather", "reduce_scatter")  # what ZeRO runs; the plan times nothing else on rings
    add(links.groups(world, per_node, 1)["dense"], "dense: every rank", 1, zero)
    exchanges = []
    tokens = _exchange_tokens(p.micro_batch * p.grad_accum, p.seq_len, shape, on_gpu)
    for ep in search.ep_sizes(shape.routed_experts, world, per_node):
        g = links.groups(world, per_node, ep)
        add(g["expert_dp"], f"expert-data-parallel at EP {ep}", ep, zero)
        if g["ep"].size > 1:
            r = rates.catalog_rate("all_to_all", g["ep"])
            exchanges.append(
                CalibrateExchange(
                    key=g["ep"].key,
                    ep_size=ep,
                    tokens=tokens,
                    top_k=shape.active_experts,
                    experts=shape.routed_experts,
                    hidden=shape.hidden,
                    expected_gbs=None if r is None else round(r.bus_gbs, 3),
                )
            )
    layer = WIRE_BYTES * gathered_layer_params(counts, world, p.ep_size)
    lo, hi = (MIN_BYTES_GPU, min(MAX_BYTES_GPU, max(MIN_TOP_GPU, layer))) if on_gpu else CPU_BYTES
    sizes = _spread(lo, hi, SIZES, multiple=world * 64)
    section = CalibratePlan(
        file=str(Path(plan.run.output_dir) / CALIBRATION_FILE),
        groups=list(shapes.values()),
        sizes_bytes=sizes,
        iters=ITERS_GPU if on_gpu else ITERS_CPU,
        gemm=PROBE_GEMM if on_gpu else PROBE_GEMM_CPU,
        attention=PROBE_ATTENTION if on_gpu else None,
        cpu_adam_params=CPU_ADAM_PARAMS_GPU if on_gpu else CPU_ADAM_PARAMS_CPU,
        threads_per_rank=threads_per_rank(cpus_per_node, per_node, gpu.is_cpu),
        fabric=fabric.name,
        exchanges=exchanges,
    )
    return plan.model_copy(update={"calibrate": section})


def _exchange_tokens(per_rank: int, seq_len: int, shape: ModelShape, on_gpu: bool) -> list[int]:
    """The token counts a rank routes per micro-step in the candidates the search weighs (every
    micro-batch that splits its batch), at most SIZES of them from the least to the most, the most
    capped where one dispatch's copies would pass MAX_BYTES_GPU."""
    copy = shape.active_experts * shape.hidden * WIRE_BYTES
    counts = sorted({m * seq_len for m in search.micro_batches(per_rank, not on_gpu)})
    cap = max(seq_len, MAX_BYTES_GPU // copy // seq_len * seq_len)
    counts = sorted({min(t, cap) for t in counts})
    if len(counts) <= SIZES:
        return counts
    step = (len(counts) - 1) / (SIZES - 1)
    return sorted({counts[round(i * step)] for i in range(SIZES)})


def _spread(lo: int, hi: int, n: int, *, multiple: int) -> list[int]:
    """`n` sizes from `lo` to `hi`, evenly on a log scale, each a multiple of `multiple` (so every
    rank's share of a reduce-scatter is whole)."""
    if hi <= lo:
        hi = lo * 2
    out = []
    for i in range(n):
        x = lo * (hi / lo) ** (i / (n - 1))
        out.append(max(multiple, int(math.ceil(x / multiple)) * multiple))
    return sorted(set(out))
