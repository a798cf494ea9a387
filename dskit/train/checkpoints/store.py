"""Atomic, self-checking checkpoints around DeepSpeed's save/load.

Layout under the checkpoint dir:
    step00000200/          DeepSpeed ZeRO-3 files + dskit-rng-rank{R}.pt + dskit-manifest-rank{R}.json
                           (+ dskit-routing-bias.safetensors: DeepSeek-V3's routing bias, routing_bias.py)
                           + dskit.json (written last: its presence means the checkpoint is complete)
    latest                 the newest complete tag (DeepSpeed's own convention, so its tools work)
    tmp-step00000300/      a save in progress; never loaded, removed at the next start
    universal/step00000200 the tag in DeepSpeed's universal layout, made when a run resumes it at another
                           world or EP size (reshard.py); removed by that run's first save

A save goes to tmp-<tag>, every rank records size and CRC-32 of the files it wrote, rank 0 writes
dskit.json and renames the directory: a crash at any point leaves either the old or the new checkpoint.
Loading walks back from the newest tag; each rank re-checks its own files (so the check scales with
the cluster), and a tag that fails anywhere (a truncated or missing file, a corrupt manifest or
dskit.json) is skipped with one warning naming what was wrong. `dskit export` runs the same check,
`tag_problem`, for every rank's files in one process (`newest_verified_tag`; both in
dskit/formats/checkpoint_layout.py, which needs no torch). Retention counts only
checkpoints that pass it, so it never deletes the last good one.

A save that finds the disk full (ENOSPC, EDQUOT: before it starts, from the previous checkpoint's
size, or while it writes) removes its own partial files, leaves the previous checkpoint as it was, and
raises DiskFull: the trainer exits EXIT_DISK_FULL, which no target retries.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dskit.errors import SpecError
from dskit.formats.checkpoint_layout import (
    DONE,
    complete_tags,
    crc,
    intact,
    manifest_name,
    read_done,
    tag_for,
    tag_problem,
)
from dskit.io.text import escape
from dskit.launch.contract import EXIT_DISK_FULL
from dskit.train.checkpoints import reshard, routing_bias
from dskit.train.checkpoints.reshard import moved

log = logging.getLogger("dskit.train")


def prune(root: Path, keep: int, saved: str | None = None) -> None:
    """Keep `saved` (the checkpoint just written) and the newest others that pass the quick check,
    `keep` in all; a damaged one never counts, so the last good checkpoint stays until a newer one has
    been written whole."""
    kept = 1 if saved else 0
    for tag in complete_tags(root):
        if tag == saved:
            continue
        if kept < keep and intact(root / tag):
            kept += 1
        else:
            shutil.rmtree(root / tag, ignore_errors=True)


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


class DiskFull(Exception):
    """A checkpoint save ran out of space; the exit code is EXIT_DISK_FULL (not retried)."""

    code = EXIT_DISK_FULL

    def __init__(
        self,
        directory: Path,
        needed: int | None,
        free: int,
        kept: str | None,
        *,
        what: str = "a checkpoint",
        kept_is: str = "the previous checkpoint",
    ):
        gib = 2**30
        need = f"about {needed / gib:.2f} GiB" if needed else "more space"
        previous = f"{kept_is} {kept} is intact" if kept else "no earlier checkpoint exists"
        super().__init__(
            f"storage.checkpoint_dir: {escape(str(directory))} is full: {what} needs {need}, {free / gib:.2f} GiB "
            f"free; {previous}. Free space or point storage.checkpoint_dir at a bigger disk, then resubmit"
        )


def _no_space(e: BaseException, root: Path) -> bool:
    """Did a write fail for want of space? ENOSPC/EDQUOT anywhere in the chain, or (torch.save's zip
    writer says only "iostream error") a disk left all but full."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    usage = shutil.disk_usage(root)
    return usage.free < min(16 * 2**20, usage.total // 20)


def _owned_by(name: str, rank: int) -> bool:
    """Which rank vouches for a file: per-rank files by their rank number, shared files by rank 0."""
    m = re.search(r"rank[_-]?(\d+)", name)
    return int(m.group(1)) == rank if m else rank == 0


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class DeepSpeedStates:
    """Model and optimizer files written and read by DeepSpeed itself (full fine-tuning). They reshard:
    a universal copy loads under another world or EP size (dskit/train/checkpoints/reshard.py)."""

    reshards = True

    def save(self, engine, root: Path, tag: str) -> None:
        engine.save_checkpoint(str(root), tag=tag, save_latest=False)

    def load(self, engine, root: Path, tag: str, *, universal: bool = False) -> None:
        # DeepSpeed reads `checkpoint.load_universal` when it loads (engine.load_universal_checkpoint()),
        # not when it builds the engine: set for this load only, since only a resharded resume needs it
        engine._config.load_universal_checkpoint = universal
        try:
            path, _ = engine.load_checkpoint(str(root), tag=tag, load_lr_scheduler_states=False)
        finally:
            engine._config.load_universal_checkpoint = False
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load {root / tag} although it verified")
        if universal:
            _unshare_steps(engine.optimizer)


def _unshare_steps(optimizer) -> None:
    """Give each optimizer state its own step counter, where torch's Adam expects it. DeepSpeed 0.19.8's
    universal loads get both wrong:
    - ZeRO-3 gives every sub-group's state one and the same `step` tensor (runtime/zero/stage3.py,
      `load_hp_checkpoint_state_from_checkpoint_dir_stage3`: `self.optimizer.state[fp32_param]['step'] =
      state_step`), and torch's AdamW adds 1 to it in place for each sub-group: the step count, and with
      it Adam's bias correction, ran ahead by the number of sub-groups per step (measured on the CPU: the
      resumed curve off by 0.75% after 8 steps, against 2e-5 with this);
    - ZeRO-1/2 loads it onto the CPU, where torch's fused AdamW (dskit's fused step) refuses it
      ("state_steps is on cpu, different from other tensors on cuda:0", seen on an H200): fused and
      capturable Adam keep the step on the parameter's device, the others on the CPU, as torch makes it."""
    inner = getattr(optimizer, "optimizer", optimizer)
    on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
    for param, state in inner.state.items():
        step = state.get("step")
        if torch.is_tensor(step):
            state["step"] = step.detach().to(param.device if on_device else "cpu", copy=True)


class Checkpointer:
    def __init__(
        self,
        root: str,
        *,
        keep: int,
        rank: int,
        world: int,
        device: torch.device,
        beat: Callable[[int, str], None] | None = None,
        layout: dict[str, int | str] | None = None,
        states=None,
        biases: dict[str, torch.Tensor] | None = None,
    ):
        """`layout`: what a checkpoint's files depend on besides the world size (the ZeRO stage, the EP
        size, the finetune method); recorded in dskit.json. A resume at another world or EP size is
        resharded where the files allow it (dskit/train/checkpoints/reshard.py); other differences are refused.
        `states`: who writes and reads the model and optimizer files: DeepSpeed (the default), or
        AdapterStates for a LoRA run (dskit/train/lora/adapter_state.py). `biases`: the routers' routing
        biases by module name, saved and restored in a file of dskit's own (routing_bias.py), which
        neither the universal checkpoint nor a LoRA run's files would carry."""
        self.root = Path(root)
        self.keep, self.rank, self.world, self.device = keep, rank, world, device
        self.layout = layout or {}
        self.states = states or DeepSpeedStates()
        self.biases = biases or {}
        # the watchdog's: verifying and loading checkpoints (a fallback reads several) takes a while
        self.beat = beat or (lambda step, phase: None)
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("tmp-step*"):
                shutil.rmtree(stale, ignore_errors=True)
            reshard.clear_stale(self.root)
        dist.barrier()

    def _reshardable(self) -> bool:
        """Can a checkpoint of another world or EP size be loaded (through its universal copy)? Full
        fine-tuning only: a LoRA run's optimizer files are dskit's own (reshard.py)."""
        return getattr(self.states, "reshards", False)

    def _refuse_other_world(self, d: Path, done: dict[str, Any]) -> None:
        # No retry can fix this: a SpecError exits 2, which Slurm does not requeue and the Job's
        # podFailurePolicy fails.
        raise SpecError(
            "hardware",
            f"checkpoint {d} was written by world size {done['world_size']}, this run has world size "
            f"{self.world}, and a LoRA run's checkpoints do not reshard: render the run with the world size of "
            "the checkpoint (hardware.nodes x hardware.gpus_per_node), or point storage.checkpoint_dir at "
            "an empty dir to start fresh",
        )

    def _refuse_other_layout(self, d: Path, done: dict[str, Any], *, resharded: bool = False) -> None:
        """DeepSpeed cannot load a checkpoint written under another ZeRO stage or optimizer (the files
        differ in kind), nor a LoRA run one of another rank or target set, nor, unless `resharded`
        (through its universal copy), one of another EP size: one line naming the setting, exit 2,
        nothing retried. Checkpoints from before the layout was recorded were all ZeRO-3."""
        written = done.get("layout")
        written = {"zero_stage": 3} if not isinstance(written, dict) else written
        # the optimizers' states differ in kind too (DeepSpeed's FusedAdam counts steps per group, torch's
        # AdamW per parameter); checkpoints from before the setting all ran DeepSpeed's
        written = {"optimizer_step": "deepspeed", **written}
        keys = (
            ("zero_stage", "overrides.zero_stage"),
            ("ep_size", "overrides.ep_size"),
            ("finetune", "finetune.method"),
            ("optimizer_step", "overrides.optimizer_step"),
            ("lora_r", "finetune.lora.r"),
            ("lora_targets", "finetune.lora.targets"),
        )
        for key, field in keys:
            if key == "ep_size" and resharded:
                continue
            was, now = written.get(key), self.layout.get(key)
            if key == "finetune":  # checkpoints and runs from before the method was recorded: full
                was, now = was or "full", now or "full"
            if was is not None and now is not None and was != now:
                raise SpecError(
                    field,
                    f"checkpoint {d} was written with {key.replace('_', ' ')} {was}, this run has {now}: set "
                    f"{field}={was} to resume it, or point storage.checkpoint_dir at an empty dir to start fresh",
                )

    # ------------------------------------------------------------------ save

    def save(self, engine, step: int, meta: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
        tag = tag_for(step)
        tmp_tag = f"tmp-{tag}"
        tmp = self.root / tmp_tag
        self._check_space()
        made = renamed = False
        try:
            # made here, so that its disappearance later means a peer removed it (below)
            tmp.mkdir(parents=True, exist_ok=True)
            made = True
            self.states.save(engine, self.root, tmp_tag)
            if self.biases:
                routing_bias.save(tmp, self.biases, rank=self.rank)
            torch.save(_rng_state(), tmp / f"dskit-rng-rank{self.rank}.pt")
            if self.rank == 0:
                for name, obj in (extra or {}).items():
                    torch.save(obj, tmp / name)
            dist.barrier()  # every rank's files are on disk
            manifest = {
                p.name: [p.stat().st_size, crc(p)]
                for p in sorted(tmp.iterdir())
                if p.is_file() and _owned_by(p.name, self.rank) and not p.name.startswith("dskit-manifest")
            }
            (tmp / manifest_name(self.rank)).write_text(json.dumps(manifest))
            dist.barrier()
            final = self.root / tag
            if self.rank == 0:
                done = {"step": step, "world_size": self.world, "layout": self.layout, "meta": meta}
                _write_synced(tmp / DONE, json.dumps(done, indent=1))
                if final.exists():  # same step saved twice (signal right after a periodic save)
                    shutil.rmtree(final)
                os.rename(tmp, final)
                renamed = True  # complete from here on: nothing below is a failed save
                try:  # `latest` is for DeepSpeed's own tools; dskit resumes from the tags themselves
                    _write_synced(self.root / "latest.tmp", tag)
                    os.replace(self.root / "latest.tmp", self.root / "latest")
                except OSError as e:
                    log.warning("checkpoint %s saved, but %s/latest not updated: %s", final, self.root, e)
                prune(self.root, self.keep, saved=tag)
                reshard.remove(self.root)  # a checkpoint of this run's own layout exists now
        except (OSError, RuntimeError) as e:  # torch.save reports a short write as a RuntimeError
            # a peer that found the disk full first removes the save's directory under this rank's writes
            if renamed or not (_no_space(e, self.root) or (made and not tmp.exists())):
                raise
            # This rank's peers may be inside DeepSpeed's collectives of the same save: they fail when
            # it exits (gloo) or their watchdog ends them; the launcher reports this rank's code.
            shutil.rmtree(tmp, ignore_errors=True)
            (self.root / "latest.tmp").unlink(missing_ok=True)
            raise DiskFull(
                self.root, self._previous_bytes(), shutil.disk_usage(self.root).free, self._kept()
            ) from e
        dist.barrier()
        log.info("checkpoint %s saved", final)
        return final

    def _kept(self) -> str | None:
        return next(iter(complete_tags(self.root)), None)

    def _previous_bytes(self) -> int | None:
        kept = self._kept()
        return _dir_bytes(self.root / kept) if kept else None

    def _check_space(self) -> None:
        """Collective: refuse to start a save the disk cannot hold (a checkpoint is as big as the one
        before it). The first save has no size to go by; a full disk then shows while it writes."""
        verdict: list[Any] = [None]
        if self.rank == 0:
            needed, free = self._previous_bytes(), shutil.disk_usage(self.root).free
            if needed is not None and free < needed:
                verdict = [(needed, free)]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            needed, free = verdict[0]
            raise DiskFull(self.root, needed, free, self._kept())

    # ------------------------------------------------------------------ load

    def load_latest(self, engine) -> dict[str, Any] | None:
        """Load the newest checkpoint that verifies everywhere; returns its metadata, or None to start
        fresh (no checkpoint yet); under another world or EP size through its universal copy. SpecError
        when checkpoints exist but none can be trusted, or when the newest good one was written under a
        layout this run cannot load (another ZeRO stage; a LoRA run's of another world or EP size)."""
        tags = complete_tags(self.root)
        # all ranks must walk the same list: take rank 0's view of the shared directory
        holder = [tags]
        dist.broadcast_object_list(holder, src=0)
        untrusted: list[str] = []
        for tag in holder[0]:
            d = self.root / tag
            self.beat(0, f"verifying {tag}")
            done, problem = read_done(d)
            change = moved(done, self.world, self.layout.get("ep_size")) if done is not None else []
            if change and not self._reshardable():
                if done["world_size"] != self.world:
                    self._refuse_other_world(d, done)
                change = []  # another EP size alone: refused below, naming overrides.ep_size
            if done is not None:
                self._refuse_other_layout(d, done, resharded=bool(change))
            if done is not None and not isinstance(done.get("meta"), dict):
                problem = f"{DONE} has no meta (the loop state)"
            # each rank checks its share of the writers' files (under another world: every world-th one)
            mine = [self.rank] if not change else list(range(self.rank, done["world_size"], self.world))
            problem = problem or tag_problem(d, mine)
            problems: list[str | None] = [None] * self.world
            dist.all_gather_object(problems, problem)
            bad = [p for p in problems if p]
            if bad:
                untrusted.append(f"{tag} ({bad[0]})")
                if self.rank == 0:
                    log.warning(
                        "checkpoint %s cannot be trusted: %s; falling back to the previous complete one",
                        d,
                        "; ".join(sorted(set(bad))[:3]),
                    )
                continue
            self.beat(0, f"loading {tag}")
            if untrusted and self.rank == 0:
                # out of the way of retention, which could otherwise keep a newer damaged one and delete
                # the checkpoints this run writes; kept for a look, under a name nothing loads
                for bad_tag in untrusted:
                    name = bad_tag.split()[0]
                    aside = self.root / f"untrusted-{name}"
                    n = 1
                    while aside.exists():
                        n, aside = n + 1, self.root / f"untrusted-{name}.{n}"
                    os.rename(self.root / name, aside)
                log.warning("moved %d untrusted checkpoint(s) aside as untrusted-stepN", len(untrusted))
            if change:
                self._load_resharded(engine, tag, change)
            else:
                self.states.load(engine, self.root, tag)
            if self.biases:
                routing_bias.restore(d, self.biases)
            if done["world_size"] == self.world:  # the same ranks (another EP size at most): their RNG
                _set_rng_state(torch.load(d / f"dskit-rng-rank{self.rank}.pt", weights_only=False))
            log.info("resumed from %s (step %d)", d, done["step"])
            return done["meta"]
        if untrusted:
            raise SpecError(
                "checkpoint",
                f"no checkpoint under {self.root} can be trusted ({', '.join(untrusted[:3])}); move them "
                "aside to start fresh, or point storage.checkpoint_dir at an empty dir",
            )
        return None

    def _load_resharded(self, engine, tag: str, change: list[str]) -> None:
        """Load `tag` under this run's world and EP size through its universal copy. Under another world
        the per-rank RNG states do not carry over (the ranks are others): each rank keeps the seeded
        state it started with."""
        if self.rank == 0:
            log.warning(
                "resharding %s: %s; loading it through DeepSpeed's universal layout", tag, ", ".join(change)
            )
        src = self.root / tag
        universal = reshard.convert(
            self.root,
            tag,
            ", ".join(change),
            rank=self.rank,
            beat=lambda phase: self.beat(0, phase),
            free_bytes=lambda: shutil.disk_usage(self.root).free,
            # the converter writes its extracted fragments, then the merged files: about twice the tag
            needed_bytes=2 * _dir_bytes(src),
            disk_full=lambda needed, free: DiskFull(
                reshard.universal_root(self.root),
                needed,
                free,
                tag,
                what=f"the universal copy of {tag} (for resharding)",
                kept_is="the checkpoint",
            ),
        )
        self.beat(0, f"loading {tag} resharded")
        self.states.load(engine, universal, tag, universal=True)


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
