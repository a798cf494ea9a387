"""The calibration job (`dskit calibrate`): time what run.yaml's `calibrate` section lists on this
cluster, and write one calibration file (dskit/calibrate/calibration.py) that the plan reads.

Started like a training run (same launcher, same launch contract: `python -m dskit.train` sees the
section and comes here). Every rank takes part in every measurement; each number is the slowest rank's,
since a collective ends when its last rank does. Rank 0 prints progress and writes the file atomically
after the last measurement, so a killed job leaves no file, or the previous one.

Measured:
- each listed group shape, every group of that shape at once (as a step runs them): all-gather and
  reduce-scatter at each size; latency and bus bandwidth fitted by least squares;
- each listed EP group: AutoEP's dispatch and combine (`_exchange_s`) at the candidates' token counts,
  fitted the same way;
- the achieved bf16 GEMM rate at the plan's expert GEMM (GPUs and CPU ranks) and, on GPUs, SDPA's rate
  at its attention;
- the host's time per layer pass of a small eager stack (`host_probe`): the launch and autograd cost
  the host pays per layer, whatever the GPU;
- DeepSpeed's CPU Adam (optimizer offload) with every rank of a node stepping at once, on each rank's
  OMP_NUM_THREADS cores, so the node's shared memory bandwidth is in the figure.
The preflight compares each group's measured rate with what its fabric should give (the plan's
`expected_gbs`) and names any far below it, in one line each.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

from dskit import __version__
from dskit.calibrate import calibration
from dskit.calibrate.calibration import BUS_GBS, Calibration, Compute, CpuAdam, Fit, Hardware

#: timed blocks per size (the quickest counts)
BLOCKS = 3
#: a group measuring below this share of its fabric's catalog rate is named by the preflight
PREFLIGHT_SHARE = 0.25


def calibrate(plan: Any, device: Any, rank: int, world: int) -> int:
    import torch.distributed as dist

    c = plan.calibrate
    say = _Progress(rank, sum(len(g.moved_share) for g in c.groups) + len(c.exchanges) + 3)
    collectives: dict[str, dict[str, Fit]] = {}
    for g in c.groups:
        mine = _join(g, rank, world)
        for op, share in g.moved_share.items():
            say(f"{op} over {g.key} ({g.role}: {world // g.size} groups of {g.size} at once)")
            points = [(s, _timed(op, mine, g.size, s, device, c.iters)) for s in c.sizes_bytes]
            collectives.setdefault(op, {})[g.key] = fit(points, share)
    for x in c.exchanges:
        say(f"AutoEP's dispatch and combine at EP {x.ep_size} ({x.key}), {len(x.tokens)} token counts")
        mine = _join(SimpleNamespace(size=x.ep_size, stride=1), rank, world)
        points = [(exchange_bytes(x, t), _exchange_s(x, t, mine, device, c.iters, rank)) for t in x.tokens]
        collectives.setdefault(calibration.EXCHANGE, {})[x.key] = fit(points, (x.ep_size - 1) / x.ep_size)
    say("GEMM and attention rates" if c.attention else "GEMM rate (attention: GPUs only)")
    gemm, gemm_why = _probe(_gemm_tflops, c.gemm, device) if c.gemm else (None, None)
    attention, attention_why = _probe(_attention_tflops, c.attention, device) if c.attention else (None, None)
    compute = Compute(
        gemm_tflops=gemm, attention_tflops=attention, host_layer_pass_s=_slowest(host_probe(device))
    )
    say(
        f"CPU Adam, every rank of a node stepping at once ({c.cpu_adam_params:,} parameters each; "
        "DeepSpeed builds its extension on first use, a minute or more)"
    )
    adam, adam_why = _cpu_adam(c.cpu_adam_params, c.threads_per_rank, plan.hardware.procs_per_node)
    skipped = [w for w in (gemm_why, attention_why, adam_why) if w]
    warnings = preflight(c.groups, c.exchanges, collectives) + skipped + _shm(plan)
    say("writing the calibration")
    if rank == 0:
        cal = Calibration(
            version=calibration.VERSION,
            dskit=__version__,
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            hardware=_hardware(plan, device),
            collectives=collectives,
            compute=compute,
            cpu_adam=adam,
            warnings=warnings,
        )
        os.makedirs(os.path.dirname(c.file), exist_ok=True)
        calibration.write(c.file, cal)
        for w in warnings:
            sys.stderr.write(f"dskit: calibrate: {w}\n")
        print(f"dskit: calibrate: wrote {c.file}", flush=True)
    dist.barrier()
    return 0


class _Progress:
    def __init__(self, rank: int, total: int):
        self.rank, self.total, self.done, self.t0 = rank, total, 0, time.monotonic()

    def __call__(self, what: str) -> None:
        self.done += 1
        if self.rank == 0:
            print(
                f"dskit: calibrate [{self.done}/{self.total}, {time.monotonic() - self.t0:.0f} s] {what}",
                flush=True,
            )


def _join(g: Any, rank: int, world: int) -> Any:
    """This rank's group among every group of `g`'s shape (all ranks create all of them, in order)."""
    import torch.distributed as dist

    if g.size == world:
        return dist.group.WORLD
    if g.stride == 1:
        members = [list(range(i, i + g.size)) for i in range(0, world, g.size)]
    else:
        members = [list(range(b, world, g.stride)) for b in range(g.stride)]
    mine, _ = dist.new_subgroups_by_enumeration(members)
    return mine


def _timed(op: str, group: Any, size: int, nbytes: int, device: Any, iters: int) -> float:
    """Seconds per call of ring `op` (all_gather, reduce_scatter) moving a whole tensor of `nbytes`
    (`_quickest_block`)."""
    import torch
    import torch.distributed as dist

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = max(size, nbytes // torch.tensor([], dtype=dtype).element_size() // size * size)
    whole = torch.zeros(n, dtype=dtype, device=device)
    part = torch.zeros(n // size, dtype=dtype, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {
        "all_gather": lambda: gather(whole, part, group=group),
        "reduce_scatter": lambda: scatter(part, whole, group=group),
    }
    return _quickest_block(calls[op], device, iters)


def _quickest_block(call: Any, device: Any, iters: int) -> float:
    """Seconds per call of `call`: BLOCKS blocks of `iters` calls after a warm-up, every rank starting
    each block at once; each block's time is the slowest rank's, and the quickest block counts (a busy
    host only ever adds time)."""
    import torch.distributed as dist

    call()
    _sync(device)
    best = float("inf")
    for _ in range(BLOCKS):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        _sync(device)
        best = min(best, _slowest((time.perf_counter() - t0) / iters))
    return best


def exchange_bytes(x: Any, tokens: int) -> int:
    """Bytes of one dispatch and its combine, whole-tensor (the fit's x before the moved share): every
    routed copy of `tokens` tokens out, and back."""
    return 2 * tokens * x.top_k * x.hidden * _WIRE


def _exchange_s(x: Any, tokens: int, group: Any, device: Any, iters: int, rank: int) -> float:
    """Seconds for one of AutoEP's dispatch-and-combine pairs at `tokens` routed tokens on this rank, as
    a MoE layer runs it (deepspeed/module_inject/auto_ep_layer.py): the per-expert counts exchanged and
    read back to the host (`compute_split_plan`), then the routed copies out and back with those uneven
    splits. Routing is uniform top-k (what the balance loss aims at); the quickest block counts, the
    slowest rank's time, as for the collectives."""
    import torch
    import torch.distributed as dist
    from deepspeed.module_inject.auto_ep_layer import compute_split_plan

    local = x.experts // x.ep_size
    gen = torch.Generator().manual_seed(1000 + rank)
    chosen = torch.rand(tokens, x.experts, generator=gen).topk(x.top_k, dim=1).indices.to(device)
    rows = torch.zeros(tokens * x.top_k, x.hidden, dtype=torch.bfloat16, device=device)

    def pair() -> None:
        split = compute_split_plan(chosen, x.experts, x.ep_size, local, group)
        routed = rows.new_empty(sum(split.output_splits), x.hidden)
        dist.all_to_all_single(routed, rows, split.output_splits, split.input_splits, group=group)
        back = torch.empty_like(rows)
        dist.all_to_all_single(back, routed, split.input_splits, split.output_splits, group=group)

    return _quickest_block(pair, device, iters)


#: bytes of a routed token copy's element on the wire (AutoEP exchanges bf16 activations)
_WIRE = 2


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def fit(points: list[tuple[int, float]], share: float) -> Fit:
    """latency + (bytes x share) / bus bandwidth, fitted by least squares on the relative error (each
    point weighted 1/t^2): the plan uses the fit from kilobytes to gigabytes, so a size's error counts
    as a share of its time, not in seconds, which would let the largest size set the line alone. Where
    the latency comes out negative (a token bucket's burst, noise) or the slope not positive, the line
    goes through the origin instead, fitted the same way."""
    xs = [b * share for b, _ in points]
    ts = [t for _, t in points]
    ws = [1 / (t * t) for t in ts]
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs, strict=True))
    st = sum(w * t for w, t in zip(ws, ts, strict=True))
    sxx = sum(w * x * x for w, x in zip(ws, xs, strict=True))
    sxt = sum(w * x * t for w, x, t in zip(ws, xs, ts, strict=True))
    det = sw * sxx - sx * sx
    slope = (sw * sxt - sx * st) / det if det else 0.0
    latency = (st - slope * sx) / sw
    if latency < 0 or slope <= 0:
        latency, slope = 0.0, sxt / sxx
    # a slope too small to tell from zero is a rate beyond what the sizes can measure: the file's ceiling
    bus_gbs = min(1 / slope / 1e9, BUS_GBS[1])
    return Fit(bus_gbs=bus_gbs, latency_s=latency, points=[(float(b), t) for b, t in points])


def preflight(groups: list[Any], exchanges: list[Any], collectives: dict[str, dict[str, Fit]]) -> list[str]:
    """One line per group and op measured far below what its fabric should give (AutoEP's exchange
    beside the catalog's all-to-all rate for its shape)."""
    wanted = [(g.key, g.role, op, expected) for g in groups for op, expected in g.expected_gbs.items()]
    wanted += [
        (x.key, f"expert-parallel at EP {x.ep_size}", calibration.EXCHANGE, x.expected_gbs) for x in exchanges
    ]
    out = []
    for key, role, op, expected in wanted:
        got = collectives.get(op, {}).get(key)
        if expected is None or got is None or got.bus_gbs >= PREFLIGHT_SHARE * expected:
            continue
        where = "across nodes" if not key.endswith("x1") else "inside a node"
        out.append(
            f"{op} over {key} ({role}) measured {got.bus_gbs:.3g} GB/s, {got.bus_gbs / expected:.0%} of the "
            f"{expected:.3g} GB/s its links should give {where}: check that NCCL uses the RDMA NICs (not TCP "
            "sockets: NCCL_DEBUG=INFO shows NET/IB), that GPUDirect RDMA is loaded, and that /dev/shm is large"
        )
    return out


def _shm(plan: Any) -> list[str]:
    try:
        total = shutil.disk_usage("/dev/shm").total
    except OSError:
        return []
    want = plan.launch.shm_bytes
    if want and total < want:
        return [
            f"/dev/shm is {total / 2**30:.2g} GiB, the plan asks for {want / 2**30:.2g} GiB: NCCL and the data loaders may fail"
        ]
    return []


def _gemm_tflops(shape: tuple[int, int, int], device: Any) -> float:
    import torch

    m, k, n = shape
    a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    b = torch.randn(k, n, dtype=torch.bfloat16, device=device)
    seconds = _best(lambda: [a @ b for _ in range(LOOP)], device) / LOOP
    return 2 * m * k * n / seconds / 1e12


def _attention_tflops(shape: tuple[int, int, int, int, int], device: Any) -> float:
    import torch
    import torch.nn.functional as F

    batch, heads, seq, qk, v = shape
    q = torch.randn(batch, heads, seq, qk, dtype=torch.bfloat16, device=device, requires_grad=True)
    k = torch.randn(batch, heads, seq, qk, dtype=torch.bfloat16, device=device, requires_grad=True)
    vv = torch.randn(batch, heads, seq, v, dtype=torch.bfloat16, device=device, requires_grad=True)

    def step() -> None:
        for _ in range(LOOP):
            F.scaled_dot_product_attention(q, k, vv, is_causal=True).sum().backward()

    seconds = _best(step, device) / LOOP
    forward = 2 * batch * heads * seq * seq * (qk + v) / 2  # causal: half the score matrix
    return 3.5 * forward / seconds / 1e12  # backward is 2.5 forwards


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every rank (each rank learns the same answer)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _probe(fn: Any, *args: Any) -> tuple[float | None, str | None]:
    """A GPU probe's rate, or (None, why) on every rank where it failed on any (out of memory, a
    kernel missing): the ranks skip its collectives together."""
    try:
        rate, why = fn(*args), None
    except Exception as e:
        rate, why = None, f"{type(e).__name__}: {str(e)[:120]}"
    if _everywhere(rate is not None):
        return _slowest_rate(rate), None
    return None, f"{fn.__name__.strip('_')} not measured ({why or 'failed on another rank'})"


def _slowest_rate(rate: float) -> float:
    return 1 / _slowest(1 / rate)


#: calls per timed repeat of a GPU probe (one GEMM is well under a millisecond), and repeats of every
#: probe: the quickest repeat counts, as interference only ever adds time
LOOP, REPEATS = 20, 7


def _best(fn: Any, device: Any, repeats: int = REPEATS) -> float:
    """The quickest of `repeats` timed calls, every rank starting each at once: a step computes on every
    rank of a node together, and ranks that share a core's units (CPU ranks on hyperthreads, one
    memory bus) run slower together than apart. Unsynchronised, the same 2-rank CPU cluster's GEMM
    probe read 0.57 and 1.01 TFLOP/s in two calibrations, as the ranks' repeats overlapped or not."""
    import torch.distributed as dist

    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


#: the host probe's stack: small enough that the device is idle, deep enough to average
PROBE_LAYERS, PROBE_WIDTH = 16, 64


def host_probe(device: Any) -> float:
    """Seconds of host time per layer pass (forward or backward) of a small eager stack: per layer a
    norm, two linears, an activation and a residual, about what a transformer layer launches outside
    its big GEMMs. Tensors are tiny, so the time is the host's (launches, autograd)."""
    import torch

    layers = [
        torch.nn.Sequential(
            torch.nn.LayerNorm(PROBE_WIDTH),
            torch.nn.Linear(PROBE_WIDTH, PROBE_WIDTH),
            torch.nn.SiLU(),
            torch.nn.Linear(PROBE_WIDTH, PROBE_WIDTH),
        ).to(device)
        for _ in range(PROBE_LAYERS)
    ]
    x0 = torch.randn(4, PROBE_WIDTH, device=device)

    def step() -> None:
        x = x0
        for layer in layers:
            x = x + layer(x)
        x.sum().backward()

    return _best(step, device, repeats=5 * REPEATS) / (2 * PROBE_LAYERS)


def _cpu_adam(params: int, threads: int, ranks: int) -> tuple[CpuAdam | None, str | None]:
    """DeepSpeed's CPU Adam over `params` parameters on `threads` cores, every rank stepping at once
    (the offloaded optimizer's step); (None, why) where its extension cannot be built here."""
    import torch
    import torch.distributed as dist

    why = None
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        torch.set_num_threads(threads)
        p = torch.nn.Parameter(torch.zeros(params, dtype=torch.float32))
        p.grad = torch.full_like(p, 1e-3)
        opt = DeepSpeedCPUAdam([p], lr=1e-4)
        opt.step()
    except Exception as e:  # its C++ build needs a compiler; say so rather than guess a rate
        why = f"{type(e).__name__}: {str(e)[:120]}"
    if not _everywhere(why is None):  # every rank skips together, or the next collectives would not pair
        return (
            None,
            f"CPU Adam not measured ({why or 'failed on another rank'}): the plan keeps its fitted rate",
        )
    seconds = float("inf")
    for _ in range(3):
        dist.barrier()  # every rank of the node steps at once, as an offloaded step does
        t0 = time.perf_counter()
        opt.step()
        seconds = min(seconds, _slowest(time.perf_counter() - t0))
    return CpuAdam(
        core_s_per_bparam=seconds * threads / (params / 1e9), ranks=ranks, threads_per_rank=threads
    ), None


def _hardware(plan: Any, device: Any) -> Hardware:
    import torch

    h = plan.hardware
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Hardware(
        gpu=h.gpu,
        fabric=plan.calibrate.fabric,
        nodes=h.nodes,
        procs_per_node=h.procs_per_node,
        device=name,
        backend="nccl" if device.type == "cuda" else "gloo",
        **calibration.versions(),
    )
