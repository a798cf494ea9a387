"""Rank 0's progress: a tqdm bar (step/total, loss, tokens/s, ETA) when stdout is a terminal, and the
ETA the log line carries either way (batch jobs have no terminal: their log is the progress)."""

from __future__ import annotations

import logging
import sys
import time
from typing import IO, Any


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def throughput_text(rec: dict[str, Any]) -> str:
    """A metrics record's tokens/s per GPU as `dskit status` and `dskit report` show it: real tokens, and
    the figure with padding beside it when rows were not full (chat: packed tails, `pad` rows)."""
    real, rows = rec.get("real_tokens_per_s_per_gpu"), rec.get("tokens_per_s_per_gpu")
    if real is None:  # written before real tokens were counted
        return "-" if rows is None else f"{rows:,.0f}"
    eff = rec.get("packing_efficiency")
    if rows is None or eff is None or eff >= 1:
        return f"{real:,.0f}"
    return f"{real:,.0f} real ({rows:,.0f} with padding; rows {eff:.0%} full)"


class Progress:
    def __init__(self, start: int, total: int, *, enabled: bool, stream: IO[str] | None = None):
        self.start, self.total = start, total
        # The rate is measured from the end of this process's first step: that step carries the
        # start-up (allocator warm-up, first communication), which would inflate the ETA.
        self.t_first: float | None = None
        self.first_done = 0
        self.bar: Any = None
        self._redirect: Any = None
        stream = stream or sys.stdout
        if enabled and _isatty(stream):
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", file=stream, dynamic_ncols=True)
            # log lines go through tqdm.write, above the bar, instead of tearing it
            self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger()])
            self._redirect.__enter__()

    def step(self, done: int, now: float | None = None) -> None:
        """Every step (cheap): the clock for the ETA, and the bar."""
        if self.t_first is None:
            self.t_first, self.first_done = now if now is not None else time.perf_counter(), done
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

    def eta_s(self, done: int, now: float | None = None) -> float | None:
        if self.t_first is None or done <= self.first_done:
            return None
        now = now if now is not None else time.perf_counter()
        return (now - self.t_first) / (done - self.first_done) * (self.total - done)

    def logged(self, rec: dict[str, Any]) -> None:
        """At log steps: loss and throughput on the bar."""
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{rec['loss']:.4f}", tok_s_gpu=f"{rec['real_tokens_per_s_per_gpu']:.0f}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False
