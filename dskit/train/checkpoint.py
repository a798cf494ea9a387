"""Atomic, self-checking checkpoints around DeepSpeed's save/load.

Layout under the checkpoint dir:
    step00000200/          DeepSpeed ZeRO-3 files + dskit-rng-rank{R}.pt + dskit-manifest-rank{R}.json
                           + dskit.json (written last: its presence means the checkpoint is complete)
    latest                 the newest complete tag (DeepSpeed's own convention, so its tools work)
    tmp-step00000300/      a save in progress; never loaded, removed at the next start

A save goes to tmp-<tag>, every rank records size and CRC-32 of the files it wrote, rank 0 writes
dskit.json and renames the directory: a crash at any point leaves either the old or the new checkpoint.
Loading walks back from the newest tag; each rank re-checks its own files (so the check scales with
the cluster), and a tag that fails anywhere is skipped with a message naming the file. `dskit export`
runs the same check for every rank's files in one process (`newest_verified_tag`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dskit.checkpoint_layout import DONE, complete_tags, tag_for
from dskit.errors import SpecError

log = logging.getLogger("dskit.train")


def _crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify_rank_files(d: Path, rank: int) -> str | None:
    """What is wrong with the files `rank` wrote into checkpoint `d` (its manifest: sizes and CRC-32s),
    or None when they all check out."""
    mf = d / f"dskit-manifest-rank{rank}.json"
    if not mf.is_file():
        return f"{mf.name} missing"
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"{mf.name} unreadable"
    if not isinstance(manifest, dict):
        return f"{mf.name} is not a mapping of file names to [size, crc]"
    for name, entry in manifest.items():
        if not _plain_name(name):
            return f"{mf.name} names {name!r}, which is not a file inside the checkpoint"
        if not (isinstance(entry, list) and len(entry) == 2 and all(_is_int(x) for x in entry)):
            return f"{mf.name} has no [size, crc] for {name!r}"
        size, crc = entry
        p = d / name
        if not p.is_file():
            return f"{name} missing"
        if p.stat().st_size != size:
            return f"{name} truncated ({p.stat().st_size} of {size} bytes)"
        if _crc(p) != crc:
            return f"{name} corrupt (checksum mismatch)"
    return None


MAX_WORLD = 1 << 20


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _plain_name(name: object) -> bool:
    """A file name directly inside the checkpoint dir: no separators, not '.', '..' or empty."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _world_size(done: Path) -> int | None:
    try:
        world = json.loads(done.read_text()).get("world_size")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return world if _is_int(world) and 1 <= world <= MAX_WORLD else None


def newest_verified_tag(root: Path) -> Path:
    """The newest complete checkpoint whose every rank's files check out, in one process (export).
    A SpecError (exit 2) when there is none."""
    if not root.is_dir():
        raise SpecError("checkpoint", f"{root} does not exist: has the run saved a checkpoint?")
    skipped: list[str] = []
    for tag in complete_tags(root):
        d = root / tag
        world = _world_size(d / DONE)
        if world is None:
            problem = f"{DONE} has no world_size (an integer from 1 to {MAX_WORLD})"
        else:
            problem = next((p for r in range(world) if (p := verify_rank_files(d, r))), None)
        if problem is None:
            for line in skipped:  # the export goes ahead: say which newer ones it passed over
                print(f"dskit: skipping {line}", file=sys.stderr)
            return d
        skipped.append(f"{d}: {problem}")
    newest = f" (newest: {skipped[0]})" if skipped else ""
    raise SpecError("checkpoint", f"no complete checkpoint under {root}{newest}")


def _owned_by(name: str, rank: int) -> bool:
    """Which rank vouches for a file: per-rank files by their rank number, shared files by rank 0."""
    m = re.search(r"rank[_-]?(\d+)", name)
    return int(m.group(1)) == rank if m else rank == 0


def _reduce_ok(ok: bool, device: torch.device) -> bool:
    t = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


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


class Checkpointer:
    def __init__(self, root: str, *, keep: int, rank: int, world: int, device: torch.device):
        self.root = Path(root)
        self.keep, self.rank, self.world, self.device = keep, rank, world, device
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("tmp-step*"):
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    # ------------------------------------------------------------------ save

    def save(self, engine, step: int, meta: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
        tag = tag_for(step)
        tmp_tag = f"tmp-{tag}"
        tmp = self.root / tmp_tag
        engine.save_checkpoint(str(self.root), tag=tmp_tag, save_latest=False)
        torch.save(_rng_state(), tmp / f"dskit-rng-rank{self.rank}.pt")
        if self.rank == 0:
            for name, obj in (extra or {}).items():
                torch.save(obj, tmp / name)
        dist.barrier()  # every rank's files are on disk
        manifest = {
            p.name: [p.stat().st_size, _crc(p)]
            for p in sorted(tmp.iterdir())
            if p.is_file() and _owned_by(p.name, self.rank) and not p.name.startswith("dskit-manifest")
        }
        (tmp / f"dskit-manifest-rank{self.rank}.json").write_text(json.dumps(manifest))
        dist.barrier()
        final = self.root / tag
        if self.rank == 0:
            done = {"step": step, "world_size": self.world, "meta": meta}
            _write_synced(tmp / DONE, json.dumps(done, indent=1))
            if final.exists():  # same step saved twice (signal right after a periodic save)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _write_synced(self.root / "latest.tmp", tag)
            os.replace(self.root / "latest.tmp", self.root / "latest")
            self._prune()
        dist.barrier()
        log.info("checkpoint %s saved", final)
        return final

    def _prune(self) -> None:
        for old in complete_tags(self.root)[self.keep :]:
            shutil.rmtree(self.root / old, ignore_errors=True)

    # ------------------------------------------------------------------ load

    def load_latest(self, engine) -> dict[str, Any] | None:
        """Load the newest checkpoint that verifies everywhere; returns its metadata, or None to start fresh."""
        tags = complete_tags(self.root)
        # all ranks must walk the same list: take rank 0's view of the shared directory
        holder = [tags]
        dist.broadcast_object_list(holder, src=0)
        for tag in holder[0]:
            d = self.root / tag
            done = json.loads((d / DONE).read_text())
            if done["world_size"] != self.world:
                # No retry can fix this (AutoEP + ZeRO-3 loads do not support a topology change upstream):
                # a SpecError exits 2, which Slurm does not requeue and the Job's podFailurePolicy fails.
                raise SpecError(
                    "hardware",
                    f"checkpoint {d} was written by world size {done['world_size']}, this run has world size "
                    f"{self.world}: render the run with the world size of the checkpoint (hardware.nodes x "
                    "hardware.gpus_per_node), or point storage.checkpoint_dir at an empty dir to start fresh",
                )
            problem = verify_rank_files(d, self.rank)
            if problem:
                log.warning("checkpoint %s: rank %d finds %s", d, self.rank, problem)
            if not _reduce_ok(problem is None, self.device):
                log.warning("checkpoint %s is incomplete or corrupt; trying the previous one", d)
                continue
            path, _ = engine.load_checkpoint(str(self.root), tag=tag, load_lr_scheduler_states=False)
            if path is None:
                raise RuntimeError(f"DeepSpeed could not load {d} although it verified")
            _set_rng_state(torch.load(d / f"dskit-rng-rank{self.rank}.pt", weights_only=False))
            log.info("resumed from %s (step %d)", d, done["step"])
            return done["meta"]
        return None


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
