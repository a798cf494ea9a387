"""Step metrics: throughput, MFU, memory, and the early-run memory watch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

GIB = 2**30


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


class MemoryWatch:
    """Warns when memory in use keeps growing over the first `window` steps. A leak (the seed post's
    data loader holding batches, a list of un-detached losses) grows steadily; a healthy run plateaus
    after its first steps. Compares host RSS and device allocations at 20%, 60% and 100% of the window."""

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


class MetricsLog:
    """One JSON record per log step in OUTPUT_DIR/metrics.jsonl (rank 0 only), appended across restarts."""

    def __init__(self, output_dir: str, enabled: bool):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
