"""Step metrics: throughput, MFU, memory, the log window the loop reports, and the early-run memory watch."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dskit.launch.contract import METRICS_FILE
from dskit.plan.schema import Plan
from dskit.train.balance import RouterTap, bias_stats, load_stats
from dskit.train.host_copy import HostCopy, on_device
from dskit.train.progress import Progress, format_eta
from dskit.train.trackers import Trackers

log = logging.getLogger("dskit.train")

GIB = 2**30
PADDING_WARN = 1 / 3  # the share of a step's computed tokens that is padding, above which rank 0 warns once


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation (PaLM, Chowdhery et al. 2022, App. B). No peak known -> None, never a guess."""
    if not peak_tflops:
        return None
    return tokens_per_s_per_gpu * flops_per_token / (peak_tflops * 1e12)


def memory_gib(device: torch.device) -> tuple[float, float]:
    """(peak allocated, peak reserved) since the last reset; on CPU, the process's peak RSS twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux reports KiB
    return rss, rss


def current_gib(device: torch.device) -> dict[str, float]:
    """Memory in use now (not peaks, which only grow): host RSS, and device allocations on a GPU."""
    import psutil

    out = {"host": psutil.Process().memory_info().rss / GIB}
    if device.type == "cuda":
        out["device"] = torch.cuda.memory_allocated(device) / GIB
    return out


def trim_host_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim(0), every arena); False where
    the C library has no malloc_trim (musl, macOS). RSS then counts the memory the process holds, not
    the freed chunks glibc keeps mapped for reuse, whose number drifts from run to run."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def held_gib(device: torch.device) -> dict[str, float]:
    """current_gib after trim_host_heap: the memory a leak would grow (what MemoryWatch compares)."""
    trim_host_heap()
    return current_gib(device)


class MemoryWatch:
    """Warns when memory in use keeps growing over the first `window` steps. A leak (the seed post's
    data loader holding batches, a list of un-detached losses) grows steadily; a healthy run plateaus
    after its first steps. Compares host RSS and device allocations at 20%, 60% and 100% of the window
    (`marks`); the loop samples them with held_gib. Raw RSS would not do: on the CPU demo the heap in
    use is flat from step 40 (0.688 GiB at steps 40..150) while glibc's free-but-mapped chunks grow
    (0.18 -> 0.30 GiB, steps 60 -> 100), so raw RSS rose 4-10% over 60..100 and warned in some runs
    of the same commit and not in others; trimmed, it rose 0.6%."""

    def __init__(
        self, window: int = 100, checkpoints: tuple[float, ...] = (0.2, 0.6, 1.0), tolerance: float = 0.05
    ):
        self.window = window
        self.marks = sorted({max(2, int(window * c)) for c in checkpoints})
        self.tolerance = tolerance
        self.seen: list[dict[str, float]] = []
        self.warned = False

    def observe(self, step: int, now: dict[str, float]) -> str | None:
        if step in self.marks:
            self.seen.append(now)
        if self.warned or len(self.seen) < len(self.marks):
            return None
        for kind in self.seen[0]:
            series = [s[kind] for s in self.seen]
            if all(b > a * (1 + self.tolerance) for a, b in zip(series, series[1:], strict=False)):
                self.warned = True
                trail = " -> ".join(f"{x:.2f}" for x in series)
                return (
                    f"{kind} memory kept growing over the first {self.window} steps ({trail} GiB at steps "
                    f"{', '.join(map(str, self.marks))}): a leak, such as a loader holding batches?"
                )
        return None


def alloc_retries(device: torch.device) -> int:
    """cudaMalloc retries so far: the caching allocator failed to allocate, freed its cached blocks
    and tried again. Each one synchronises the device; near capacity they repeat every step."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def alloc_retry_warning(retries: int, steps: int, reserved_gib: float, capacity_gib: float | None) -> str:
    cap = f" of {capacity_gib:.1f}" if capacity_gib else ""
    return (
        f"the GPU memory allocator retried {retries} time(s) over the last {steps} step(s) (peak reserved "
        f"{reserved_gib:.1f}{cap} GiB on rank 0): it frees its cache and synchronises on each retry, which "
        "near capacity can make steps several times slower; lower overrides.micro_batch, or set "
        "overrides.activation_checkpointing=1, to leave headroom"
    )


class MetricsLog:
    """One JSON record per log step in OUTPUT_DIR/metrics.jsonl (rank 0 only), appended across restarts."""

    def __init__(self, output_dir: str, enabled: bool, name: str = METRICS_FILE):
        self.enabled = enabled
        self.path = Path(output_dir) / name
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


class LogWindow:
    """Loss and aux loss summed over the steps since the last log line, reported every
    `run.log_every` steps (and at the last): averaged over ranks, with throughput, MFU, memory and
    expert load, as one metrics.jsonl record (the trackers get the same record) and one log line on rank 0.

    On a GPU a log step's figures are reduced and copied to the host behind its work, and the record is
    written when the next step has been queued (or at `flush`, which the loop calls before an eval, a
    checkpoint and the end): reading them at once would make the host wait for the GPU to drain, and the
    GPU then wait for the host to log and launch the next step (a bubble every log step; every step in
    the benches, which log each one). The window's time is the GPU's own, between CUDA events. On CPU ranks the device is
    the host: the record is written at its step, timed by the host's clock."""

    def __init__(self, plan: Plan, *, rank: int, world: int, device: torch.device, start: int = 0):
        self.plan, self.rank, self.world, self.device = plan, rank, world, device
        # A resumed process marks its first record with the checkpoint step it resumed from: a clean
        # stop (STOP file, SIGTERM) checkpoints at the step it stopped, so the steps never go backwards
        # and `dskit report` could not otherwise tell where the run restarted.
        self.resumed_from = start or None
        par = plan.parallel
        self.capacity_per_step_rank = par.micro_batch * par.grad_accum * par.seq_len
        self.padding_warned = False
        self.metrics = MetricsLog(plan.run.output_dir, enabled=rank == 0)
        # TensorBoard, MLflow, W&B: what the plan turns on; a resumed process continues their runs
        self.trackers = Trackers(plan, enabled=rank == 0, resumed=start > 0)
        self.progress = Progress(start, plan.optim.steps, enabled=rank == 0)
        self.loss_sum = torch.zeros((), device=device)
        self.aux_sum = torch.zeros((), device=device)
        self.last: dict = {}  # the latest record written (Ray Train reports it with each checkpoint)
        self.retries_seen = alloc_retries(device)
        self.retries_warned = False
        self.skipped_seen = 0
        self.deferred = device.type == "cuda"  # records written a log step late (see the class)
        self.pending: _Pending | None = None
        self.started: torch.cuda.Event | None = None
        self._reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _reset(self) -> None:
        self.loss_sum.zero_()
        self.aux_sum.zero_()
        self.steps, self.t0 = 0, time.perf_counter()
        self.real_tokens = self.row_tokens = 0
        if self.device.type == "cuda" and self.started is None:
            self.started = torch.cuda.Event(enable_timing=True)
            self.started.record()

    def add(self, ce: torch.Tensor, aux: torch.Tensor, *, real_tokens: int, row_tokens: int) -> None:
        """One micro-batch: its losses (detached here; the sums never hold the graph), the tokens that
        belong to a sample and the tokens its rows hold (padding included: what the GPU computed)."""
        accum = self.plan.parallel.grad_accum
        self.loss_sum += ce.detach() / accum
        self.aux_sum += aux.detach() / accum
        self.real_tokens += real_tokens
        self.row_tokens += row_tokens

    def step_done(self, done: int, lr: float, tap: RouterTap, skipped: torch.Tensor | None = None) -> None:
        """Close step `done`; at a log step, reduce over ranks (collective) and write the record (on a GPU
        at the next step: see the class). `skipped`: the fused step's count of skipped
        steps on the device (dskit/train/fused_step.py `skipped_counter`), warned about when it grows."""
        self.steps += 1
        self.progress.step(done)
        logs = not (done % self.plan.run.log_every) or done == self.plan.optim.steps
        taken = self._reduce(done, lr, tap, skipped) if logs else None
        self.flush()  # the last log step's, a step late: its work is done, this step's is queued behind it
        self.pending = taken
        if not self.deferred:
            self.flush()

    def _reduce(self, done: int, lr: float, tap: RouterTap, skipped: torch.Tensor | None) -> _Pending:
        """The log step's figures over all ranks, on their way to the host (collective); the window
        starts again."""
        stats = torch.stack([self.loss_sum, self.aux_sum]) / self.steps
        dist.all_reduce(stats)
        stats /= self.world
        load = tap.take_load()
        if load is not None:
            dist.all_reduce(load)
        # float64: exact token counts far beyond what one window holds
        counts = on_device([self.real_tokens, self.row_tokens], torch.float64, self.device)
        dist.all_reduce(counts)
        counts /= self.world
        values = {"stats": stats, "counts": counts, "load": load, "bias": tap.bias_tensors()}
        if skipped is not None:
            values["skipped"] = skipped
        retries = alloc_retries(self.device)
        if self.device.type == "cuda":
            worst = on_device([retries - self.retries_seen], torch.int64, self.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            values["retries"] = worst
        self.retries_seen = retries
        host = HostCopy({k: v for k, v in values.items() if v is not None}, timed=True)
        if host.event is not None:
            timing: float | tuple = (self.started, host.event)
            self.started = host.event  # the next window starts where this one ends, on the GPU's clock
        else:
            timing = time.perf_counter() - self.t0
        alloc, reserved = memory_gib(self.device)
        taken = _Pending(done, lr, self.steps, time.time(), timing, host, alloc, reserved)
        if self.plan.parallel.cuda_graphs:  # what ran: graphs planned but not captured are counted here
            from dskit.train.compile import cuda_graph_skips

            taken.graph_skips = cuda_graph_skips()
        if self.resumed_from is not None:
            taken.resumed_from, self.resumed_from = self.resumed_from, None
        self._reset()
        return taken

    def flush(self) -> None:
        """Write the record still on its way from the GPU, if any (waits for that step's work only)."""
        p, self.pending = self.pending, None
        if p is None:
            return
        v = p.host.wait()
        if isinstance(p.timing, tuple):
            started, ended = p.timing
            elapsed = started.elapsed_time(ended) / 1e3
        else:
            elapsed = p.timing
        loss, aux = v["stats"].tolist()
        real, rows = v["counts"].tolist()
        real_s = real / elapsed
        rec = {
            "step": p.done,
            "loss": loss,
            "aux_loss": aux,
            "lr": p.lr,
            # what the GPU computed, padding included (the figure benches have always compared) ...
            "tokens_per_s_per_gpu": round(rows / elapsed, 1),
            # ... and the tokens of real samples, which MFU counts: padding is no useful work
            "real_tokens_per_s_per_gpu": round(real_s, 1),
            "packing_efficiency": round(real / (self.capacity_per_step_rank * p.steps), 4),
            "mfu": _round(mfu(real_s, self.plan.model.flops_per_token, self.plan.hardware.peak_tflops)),
            "peak_alloc_gib": round(p.alloc, 3),
            "peak_reserved_gib": round(p.reserved, 3),
            "step_time_s": round(elapsed / p.steps, 4),
            "time": p.time,
        }
        if "load" in v:
            rec.update(load_stats(v["load"]))
        rec.update(bias_stats(v.get("bias")))
        if "retries" in v:
            rec["alloc_retries"] = self._warn_retries(int(v["retries"].item()), p.steps, rec)
        if p.graph_skips is not None:
            rec["cuda_graph_skips"] = p.graph_skips
        if p.resumed_from is not None:
            rec["resumed_from"] = p.resumed_from
        self._warn_padding(rows, real, p.steps)
        self.metrics.write(rec)
        self.trackers.write(rec)
        self.progress.logged(rec)
        self.last = rec
        if self.rank == 0:
            eta = self.progress.eta_s(p.done)
            log.info("%s", log_line(rec, self.plan.optim.steps, p.alloc, p.reserved, eta))
        if "skipped" in v:
            self._warn_skipped(int(v["skipped"].item()), p.done)

    def _warn_padding(self, rows: float, real: float, steps: int) -> None:
        """Once per process: more than a third of what the GPU computed was padding."""
        if self.padding_warned or self.rank != 0 or rows <= 0 or (rows - real) / rows <= PADDING_WARN:
            return
        self.padding_warned = True
        hint = "a shorter training.seq_len suits short samples"
        if self.plan.run.packing == "pad":
            hint = "data.packing=pack fills rows with whole samples; " + hint
        log.warning(
            "%.0f%% of the tokens computed over the last %d step(s) were padding (rows %.0f%% full): %s",
            100 * (rows - real) / rows,
            steps,
            100 * real / (self.capacity_per_step_rank * steps),
            hint,
        )

    def _warn_retries(self, n: int, steps: int, rec: dict) -> int:
        """The most allocator retries any rank had over the record's window; warns once."""
        if n and not self.retries_warned and self.rank == 0:
            self.retries_warned = True
            capacity = self.plan.memory.get("capacity_gib")
            log.warning(alloc_retry_warning(n, steps, rec["peak_reserved_gib"], capacity))
        return n

    def _warn_skipped(self, n: int, done: int) -> None:
        """Each log step where the fused step's skipped count grew."""
        if n > self.skipped_seen and self.rank == 0:
            log.warning(
                "%d optimizer step(s) skipped by step %d: the gradient norm was not finite (inf or NaN); "
                "the weights and optimizer states were left as they were",
                n,
                done,
            )
        self.skipped_seen = n

    def close(self) -> None:
        """Write the last record and flush the loggers: the process is about to exit (finished, or
        stopped for a requeue)."""
        self.flush()
        self.trackers.close()
        self.progress.close()


@dataclass
class _Pending:
    """A log step's record on its way from the GPU: what `LogWindow.flush` needs to write it."""

    done: int
    lr: float
    steps: int
    time: float
    timing: float | tuple  # seconds (CPU ranks), or the window's two CUDA events
    host: HostCopy  # the reduced figures, on their way to the host
    alloc: float
    reserved: float
    graph_skips: int | None = None
    resumed_from: int | None = None


def log_line(rec: dict, total: int, alloc_gib: float, reserved_gib: float, eta_s: float | None) -> str:
    """Rank 0's line for a metrics record. A figure the run does not have is left out, not printed as
    None: MFU without a peak FLOP/s (CPU ranks, a GPU profile without one), the expert load of a step
    that routed nothing."""
    efficiency = rec["packing_efficiency"]
    words = [
        f"step {rec['step']}/{total} loss {rec['loss']:.4f} aux {rec['aux_loss']:.5f} lr {rec['lr']:.3g}",
        f"{rec['real_tokens_per_s_per_gpu']:.0f} tok/s/gpu"
        + ("" if efficiency >= 1 else f" (real; rows {efficiency:.0%} full)"),
        *([] if rec["mfu"] is None else [f"mfu {rec['mfu']}"]),
        f"mem {alloc_gib:.2f}/{reserved_gib:.2f} GiB",
        *(
            []
            if rec.get("expert_load_max_over_mean") is None
            else [f"load {rec['expert_load_max_over_mean']}"]
        ),
        f"eta {format_eta(eta_s)}",
    ]
    return " ".join(words)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
