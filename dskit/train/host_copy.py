"""Device figures read a step late: copied to the host behind the work that computes them, read once that
work is done. Reading a GPU tensor at once (`.item()`, `.tolist()`) makes the host wait for everything queued
before it, and the GPU then waits for the host to queue the next step: a bubble each time. The log window
(dskit/train/metrics.py) and the stop request's agreement (dskit/train/loop.py) read theirs at the next
step, when the next step's work is already queued behind them."""

from __future__ import annotations

import torch


class HostCopy:
    """`tensors` copied to page-locked host memory behind the work queued before them (GPU tensors), or
    cloned (CPU tensors: safe from later in-place updates); `wait()` returns them once they have landed.
    `timed`: the event after the copies can end a CUDA-event timing (`event`)."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, timed: bool = False):
        self.host = {
            k: t.to("cpu", non_blocking=True) if t.is_cuda else t.clone() for k, t in tensors.items()
        }
        self.event: torch.cuda.Event | None = None
        if any(t.is_cuda for t in tensors.values()):
            self.event = torch.cuda.Event(enable_timing=timed)
            self.event.record()

    def wait(self) -> dict[str, torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def on_device(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host values on `device` without waiting for the GPU: `torch.tensor(values, device=...)`
    copies from pageable memory and synchronises the stream; from page-locked memory the copy is queued."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
