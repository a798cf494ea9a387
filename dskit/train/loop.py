"""The training loop: reads top to bottom; every number comes from the plan."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dskit.data import IGNORE_INDEX
from dskit.data.sampler import DataPosition, Mixture, Sampler
from dskit.launch.contract import COMPLETE_FILE, EVAL_FILE, EXIT_REQUEUE, STOP_FILE
from dskit.plan.schema import Plan
from dskit.train.attention import packed_rows, rows_of
from dskit.train.balance import RouterTap
from dskit.train.checkpoints.store import Checkpointer
from dskit.train.fused_step import skipped_counter, step_taken
from dskit.train.host_copy import HostCopy, on_device
from dskit.train.lora.adapter_state import AdapterStates
from dskit.train.metrics import LogWindow, MemoryWatch, MetricsLog, held_gib
from dskit.train.profile import StepProfiler
from dskit.train.schedule import lr_at
from dskit.train.trackers import Trackers
from dskit.train.watchdog import Watchdog

log = logging.getLogger("dskit.train")
PROBE_TOKENS = 64


class StopRequest:
    """SIGTERM/SIGUSR1 on any rank, or the launcher's STOP file, asks every rank to checkpoint and exit."""

    def __init__(self, checkpoint_dir: str, rank: int, device: torch.device):
        self.flag = False
        self.rank, self.device = rank, device
        # GPU ranks agree a step late (see `requested`); the agreement on its way to the host
        self.late = device.type == "cuda"
        self.in_flight: HostCopy | None = None
        self.file = Path(checkpoint_dir) / STOP_FILE
        # Ray Train runs the loop in a worker thread, where Python cannot install handlers: there the STOP
        # file and Ray's own worker-group restarts cover stop requests.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.flag = True
        log.warning(
            "rank %d: %s received; checkpointing after this step", self.rank, signal.Signals(signum).name
        )

    def _file_requested(self) -> bool:
        # Launchers delete stale files before starting ranks, so any file here is a live request, even
        # one made before this process started (a time-limit signal during start-up).
        try:
            made = self.file.stat().st_mtime
        except FileNotFoundError:
            return False
        if not self.flag:
            # When the request was made, to the millisecond: with metrics.jsonl's step times it shows
            # that the checkpoint came at the first step boundary after it.
            when = datetime.fromtimestamp(made, timezone.utc).isoformat(timespec="milliseconds")
            log.warning("rank 0: %s written at %s; checkpointing after this step", self.file.name, when)
            self.flag = True
        return True

    def requested(self) -> bool:
        """Collective: every rank must call it at the same step. One rank decides alone. GPU ranks agree a
        step late: the all-reduce of this step's requests and its copy to the host are queued behind the
        step's work and read at the next call, when that work is done and the next step is queued, so
        the host never drains the GPU to ask (every rank reads the same agreement at the same step).
        CPU ranks agree at the step itself."""
        local = self.flag or (self.rank == 0 and self._file_requested())
        if dist.get_world_size() == 1:
            return local
        t = on_device([1 if local else 0], torch.int64, self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if not self.late:
            return bool(t.item())
        previous, self.in_flight = self.in_flight, HostCopy({"asked": t})
        return previous is not None and bool(previous.wait()["asked"].item())

    def clear_file(self) -> None:
        if self.rank == 0:
            self.file.unlink(missing_ok=True)


def train(
    plan: Plan,
    engine,
    tap: RouterTap,
    sampler: Sampler | Mixture,
    eval_sampler: Sampler | None = None,
    *,
    rank: int,
    world: int,
    device: torch.device,
    watchdog: Watchdog,
    reporter: Callable[[dict], None] | None = None,
) -> int:
    """Resume, run the steps from there, checkpoint, stop on request; returns the process's exit code
    (0, or EXIT_REQUEUE after a stop request's checkpoint)."""
    opt, run = plan.optim, plan.run
    ckpt = Checkpointer(
        run.checkpoint_dir,
        keep=run.checkpoint_keep,
        rank=rank,
        world=world,
        device=device,
        beat=watchdog.beat,
        layout=_layout(plan),
        states=AdapterStates(rank, world) if plan.finetune else None,
        biases=tap.named_biases,
    )
    stop = StopRequest(run.checkpoint_dir, rank, device)
    watch = MemoryWatch()
    profiler = StepProfiler(run.profile_steps, opt.steps, run.output_dir, rank, device)

    # ---------------------------------------------------------------- resume
    position = _resume(ckpt, engine, watchdog, plan.parallel.global_batch)
    start = position.step
    if start >= opt.steps:
        log.info("all %d steps already done", opt.steps)
        _mark_complete(run.output_dir, rank)
        return 0
    log.info("training steps %d..%d", start + 1, opt.steps)
    window = LogWindow(plan, rank=rank, world=world, device=device, start=start)
    evals = _evaluator(plan, eval_sampler, window, watchdog, rank=rank, world=world, device=device)
    save = _Saver(plan, engine, ckpt, watchdog, window, reporter, position=position)

    # ---------------------------------------------------------------- loop
    try:
        for step in range(start, opt.steps):
            lr = _set_lr(engine, plan, step)
            _micro_steps(
                plan, engine, tap, sampler, window, step, position, rank=rank, world=world, device=device
            )
            done = step + 1
            watchdog.beat(done)
            profiler.after_step(done)

            # ------------------------------------------------------------ log
            window.step_done(done, lr, tap, skipped_counter(engine))
            warning = watch.observe(done, held_gib(device)) if done in watch.marks else None
            if warning and rank == 0:
                log.warning(warning)

            # ------------------------------------------------------------ eval
            if evals and (done % run.eval_every == 0 or done == opt.steps):
                window.flush()  # the step's record first: the eval loss joins it
                window.last["eval_loss"] = evals.run(engine, done)
                watchdog.beat(done)

            # ------------------------------------------------------------ checkpoint / stop
            if done == opt.steps:
                break
            if _checkpoint_or_stop(done, run.checkpoint_every, stop, save, window):
                return EXIT_REQUEUE
    except BaseException:
        # a step that failed (out of memory, a collective's timeout) still leaves the record of the
        # step before it, written a step late on a GPU; its work is done, so the wait is short
        with contextlib.suppress(Exception):
            window.flush()
        raise

    # ---------------------------------------------------------------- finish
    window.flush()  # the last step's record before the run is marked complete
    if run.checkpoint_final:
        save(opt.steps, extra={"probe.pt": _probe(plan, engine, sampler, device)})
    _mark_complete(run.output_dir, rank)
    stop.clear_file()
    window.close()
    return 0


def _layout(plan: Plan) -> dict[str, int | str]:
    """What the checkpoint's files depend on besides the world size; a LoRA run's files are not
    DeepSpeed's (its layout names the method; a full run's stays as before, with no method)."""
    layout: dict[str, int | str] = {
        "zero_stage": plan.parallel.zero_stage,
        "ep_size": plan.parallel.ep_size,
        "optimizer_step": plan.parallel.optimizer_step,
    }
    if plan.finetune is not None:
        layout["finetune"] = plan.finetune.method
        # the adapters' shapes and names: another rank or target set finds none of its tensors
        layout["lora_r"] = plan.finetune.r
        layout["lora_targets"] = f"[{', '.join(plan.finetune.targets)}]"
    return layout


def _resume(ckpt: Checkpointer, engine, watchdog: Watchdog, batch: int) -> DataPosition:
    """The newest verified checkpoint loaded into the engine (if any); returns where it left the data."""
    meta = ckpt.load_latest(engine)
    start = meta["step"] if meta else 0
    samples = meta.get("samples") if meta else 0
    if not isinstance(samples, int) or samples < 0:  # checkpoints that did not record it: this batch
        samples = start * batch
    if samples != start * batch:
        log.warning(
            "the checkpoint of step %d was written at %d samples (a global batch of %g); this run's batch is "
            "%d: the data continues from sample %d, none skipped or repeated",
            start, samples, samples / max(start, 1), batch, samples,
        )  # fmt: skip
    watchdog.begin(start)  # the first step carries compiles and warm-up
    return DataPosition(start, samples, batch)


def _evaluator(
    plan: Plan,
    sampler: Sampler | None,
    window: LogWindow,
    watchdog: Watchdog,
    *,
    rank: int,
    world: int,
    device: torch.device,
) -> Evaluator | None:
    """The eval loss's runner where the plan has a held-out set; it writes to the training log's
    TensorBoard and beats the training watchdog."""
    if not sampler:
        return None
    return Evaluator(
        plan, sampler, rank=rank, world=world, device=device, trackers=window.trackers, beat=watchdog.beat
    )


class _Saver:
    """save(step, extra files): a checkpoint at `step`, under the watchdog, reported to Ray Train."""

    def __init__(
        self,
        plan: Plan,
        engine,
        ckpt: Checkpointer,
        watchdog: Watchdog,
        window: LogWindow,
        reporter: Callable[[dict], None] | None,
        *,
        position: DataPosition,
    ):
        self.plan, self.engine, self.ckpt, self.watchdog = plan, engine, ckpt, watchdog
        self.window, self.reporter, self.position = window, reporter, position

    def __call__(self, step: int, extra: dict | None = None) -> None:
        self.window.flush()  # the records up to the checkpoint are written before it
        info = {"step": step, "samples": self.position.first(step), "plan": self.plan.name}
        self.watchdog.beat(step, "checkpoint save")
        path = self.ckpt.save(self.engine, step, info, extra=extra)
        self.watchdog.beat(step, "step")
        # Ray Train: report at each checkpoint, on every rank (report() is collective). Not every log
        # step: a report took ~2 s on the CPU test cluster, longer than a step.
        # The per-expert counts (layers x experts ints) stay in metrics.jsonl, out of Ray's result rows.
        if self.reporter:
            last = {k: v for k, v in self.window.last.items() if k != "expert_counts"}
            self.reporter({**last, "step": step, "checkpoint": str(path)})


def _set_lr(engine, plan: Plan, step: int) -> float:
    """The schedule's learning rate for `step`, set on every parameter group; returned for the log."""
    opt = plan.optim
    lr = lr_at(step, lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.warmup_steps, total_steps=opt.steps)
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    return lr


def _micro_steps(
    plan: Plan,
    engine,
    tap: RouterTap,
    sampler: Sampler | Mixture,
    window: LogWindow,
    step: int,
    position: DataPosition,
    *,
    rank: int,
    world: int,
    device: torch.device,
) -> None:
    """One optimizer step: grad_accum micro-steps of forward, balance loss and backward (DeepSpeed's
    engine.step() updates the weights at the accumulation boundary), then the routing bias update."""
    par = plan.parallel
    for micro in range(par.grad_accum):
        first = position.micro_batch_start(
            step, micro, rank, grad_accum=par.grad_accum, world=world, micro_batch=par.micro_batch
        )
        batch = sampler.get(first, par.micro_batch)
        inputs, labels, extra = _to_device(batch, device)
        if par.cuda_graphs:  # the last micro-step's graph outputs are dead: its backward has run
            torch.compiler.cudagraph_mark_step_begin()
        # the backward too: activation checkpointing re-runs attention inside it
        with rows_of(packed_rows(batch.position_ids, device)):
            tap.start()
            ce = _loss(engine, inputs, labels, extra, chunked=bool(par.loss_chunk_tokens))
            tap.stop()
            aux = tap.aux_loss(par.micro_batch, plan.model.aux_loss_coeff, plan.model.seq_aux)
            engine.backward(ce + aux)
        engine.step()
        window.add(ce, aux, real_tokens=batch.real_tokens, row_tokens=inputs.numel())
    # balance aux_free: the routing bias moves against this step's load (collective), unless it was skipped
    tap.after_step(step_taken(engine))


def _checkpoint_or_stop(done: int, every: int, stop: StopRequest, save: _Saver, window: LogWindow) -> bool:
    """After any step but the last: True (exit to be requeued) once a stop request has been checkpointed;
    else a checkpoint every `every` steps. Collective: every rank asks at the same step."""
    if stop.requested():
        save(done)
        stop.clear_file()
        window.close()
        log.warning("stopped at step %d on request; exiting with %d (requeue)", done, EXIT_REQUEUE)
        return True
    if done % every == 0:
        save(done)
    return False


class Evaluator:
    """Mean cross-entropy per labelled token over the same held-out samples every time (so the values
    are comparable across steps): `eval_batches` micro-batches per rank, fewer when the held-out set
    holds fewer samples than that, never repeating one. Collective: every rank calls it at the same
    step. One record per eval in OUTPUT_DIR/eval.jsonl (metrics.jsonl keeps one training record per
    log step, which `dskit status` and `dskit report` read), the trackers' `eval_loss` (TensorBoard
    `eval/loss`), one log line."""

    def __init__(
        self,
        plan: Plan,
        sampler: Sampler,
        *,
        rank: int,
        world: int,
        device: torch.device,
        trackers: Trackers,
        beat: Callable[[int, str], None],
    ):
        self.sampler, self.rank, self.world, self.device = sampler, rank, world, device
        self.beat = beat  # the watchdog's: an eval may be many steps long
        self.micro = plan.parallel.micro_batch
        self.chunked = bool(plan.parallel.loss_chunk_tokens)
        self.batches = min(plan.run.eval_batches, sampler.windows // (world * self.micro))
        # >= 1: entry._eval_sampler refused a held-out set smaller than one micro-batch per rank
        self.metrics = MetricsLog(plan.run.output_dir, enabled=rank == 0, name=EVAL_FILE)
        self.trackers = trackers  # the training log's: its TensorBoard event file, MLflow and W&B runs

    def run(self, engine, step: int) -> float:
        t0 = time.perf_counter()
        engine.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss x tokens, tokens
        with torch.no_grad():
            for b in range(self.batches):
                self.beat(step, f"eval batch {b + 1}/{self.batches}")
                first = (b * self.world + self.rank) * self.micro
                batch = self.sampler.get(first, self.micro)
                inputs, labels, extra = _to_device(batch, self.device)
                n = (labels != IGNORE_INDEX).sum()
                with rows_of(packed_rows(batch.position_ids, self.device)):
                    ce = _loss(engine, inputs, labels, extra, chunked=self.chunked)
                sums += torch.stack([ce.double() * n, n.double()])
        engine.train()
        dist.all_reduce(sums)
        loss = (sums[0] / sums[1].clamp(min=1)).item()
        rec = {"step": step, "eval_loss": loss, "eval_tokens": int(sums[1].item()), "time": time.time()}
        self.metrics.write(rec)
        self.trackers.write(rec)
        if self.rank == 0:
            log.info(
                "eval step %d loss %.4f over %d tokens (%.1f s)",
                step,
                loss,
                rec["eval_tokens"],
                time.perf_counter() - t0,
            )
        return loss


def _to_device(b, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(input_ids, labels, extra model kwargs). Packed chat rows carry position ids that restart at
    each sample: RoPE takes them, and attention is confined to each sample by them (transformers' dense
    mask for SDPA and eager, `rows_of`'s cu_seqlens for FlashAttention)."""
    inputs = torch.from_numpy(b.input_ids).to(device, non_blocking=True)
    labels = torch.from_numpy(b.labels).to(device, non_blocking=True)
    positions = b.position_ids
    extra = (
        {}
        if positions is None
        else {"position_ids": torch.from_numpy(positions).to(device, non_blocking=True)}
    )
    return inputs, labels, extra


def _loss(engine, inputs: torch.Tensor, labels: torch.Tensor, extra: dict, *, chunked: bool) -> torch.Tensor:
    """Mean cross-entropy over the tokens with a label (IGNORE_INDEX: prompt turns, padding)."""
    if chunked:  # the model computes the loss without materialising the logits
        return engine(input_ids=inputs, labels=labels, **extra).loss
    logits = engine(input_ids=inputs, **extra).logits
    flat = labels.reshape(-1)
    # sum / count, not reduction="mean": a micro-batch whose rows are all prompt would give 0/0 = NaN
    total = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), flat, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / (flat != IGNORE_INDEX).sum().clamp(min=1)


def _probe(plan: Plan, engine, sampler: Sampler | Mixture, device: torch.device) -> dict[str, torch.Tensor]:
    """Probe logits for the final checkpoint, which `dskit export` uses to verify its output."""
    n = min(PROBE_TOKENS, plan.parallel.seq_len)
    # The first sample's own tokens (a packed chat row's first sample starts at 0), no position ids:
    # export compares them with a plain Hugging Face forward.
    probe = torch.from_numpy(sampler.get(0, 1).input_ids[:, :n]).to(device)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe).logits.float().cpu()
    engine.train()
    return {"input_ids": probe.cpu(), "logits": logits}


def _mark_complete(output_dir: str, rank: int) -> None:
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        Path(output_dir, COMPLETE_FILE).write_text("complete\n")
