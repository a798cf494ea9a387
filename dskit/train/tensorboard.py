"""TensorBoard events in OUTPUT_DIR/tensorboard/ (rank 0), from the same record as metrics.jsonl.

On by default when the `tensorboard` package is importable (the `train` extra); without it the run
warns once and goes on. A logger must never stop training: any error while writing warns once and
turns this logger off. torch's SummaryWriter queues events to a background thread, so a log step
costs the queueing and the flush that makes a running run's curves current.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("dskit.train")
TB_DIR = "tensorboard"

# metrics.jsonl key -> TensorBoard tag
SCALARS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "aux_loss": "train/aux_loss",
    "lr": "train/lr",
    "tokens_per_s_per_gpu": "perf/tokens_per_s_per_gpu",
    "real_tokens_per_s_per_gpu": "perf/real_tokens_per_s_per_gpu",
    "packing_efficiency": "data/packing_efficiency",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "peak_alloc_gib": "memory/peak_alloc_gib",
    "peak_reserved_gib": "memory/peak_reserved_gib",
    "expert_load_max_over_mean": "experts/max_over_mean_worst_layer",
    "expert_bias_spread": "experts/bias_spread_widest_layer",
}


class TensorBoardLog:
    name = "TensorBoard"  # a Tracker (dskit/train/trackers.py) that handles its own failures

    def __init__(self, output_dir: str | Path, enabled: bool):
        self.writer: Any = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch raises ImportError naming tensorboard when the package is missing
            log.warning("tensorboard is not installed (pip install tensorboard): no TensorBoard events")
            return
        try:
            self.writer = SummaryWriter(log_dir=str(Path(output_dir) / TB_DIR))
        except Exception as e:  # an unwritable dir must not stop training
            log.warning("TensorBoard logger off: cannot open %s/%s: %s", output_dir, TB_DIR, e)

    def write(self, rec: dict[str, Any]) -> None:
        if self.writer is None:
            return
        try:
            self._write(rec)
        except Exception as e:
            log.warning("TensorBoard logger off after an error (training goes on): %r", e)
            self._close_quietly()

    def _write(self, rec: dict[str, Any]) -> None:
        w, step = self.writer, rec["step"]
        for key, tag in SCALARS.items():
            if rec.get(key) is not None:
                w.add_scalar(tag, rec[key], step)
        for i, x in enumerate(rec.get("expert_load_per_layer") or []):
            w.add_scalar(f"experts/max_over_mean/moe_layer_{i}", x, step)
        for i, x in enumerate(rec.get("expert_bias_spread_per_layer") or []):
            w.add_scalar(f"experts/bias_spread/moe_layer_{i}", x, step)
        for i, row in enumerate(rec.get("expert_counts") or []):
            _expert_histogram(w, f"experts/tokens_per_expert/moe_layer_{i}", row, step)
        w.flush()

    def close(self) -> None:
        if self.writer is not None:
            self._close_quietly()

    def _close_quietly(self) -> None:
        w, self.writer = self.writer, None
        try:
            w.close()
        except Exception:
            pass


def _expert_histogram(w: Any, tag: str, counts: list[int], step: int) -> None:
    """One bucket per expert, its height the tokens routed to it: TensorBoard's histogram view then
    reads as tokens over expert index (a collapsing router is a spike), step after step."""
    n = len(counts)
    total = float(sum(counts))
    w.add_histogram_raw(
        tag,
        min=0.0,
        max=float(n - 1),
        num=total,
        sum=float(sum(i * c for i, c in enumerate(counts))),
        sum_squares=float(sum(i * i * c for i, c in enumerate(counts))),
        bucket_limits=[i + 0.5 for i in range(n)],
        bucket_counts=[float(c) for c in counts],
        global_step=step,
    )
