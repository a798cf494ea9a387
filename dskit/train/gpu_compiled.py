"""A function torch.compile'd where it runs on a GPU, eager elsewhere: the CPU test runs would pay a C++
compile for kernels whose point is the GPU's memory traffic (the loss chunk, the optimizer's one pass)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def on_gpu(fn: Callable, **options) -> Callable[[torch.device], Callable]:
    """`pick(device)`: `fn` compiled with `options` (once, at the first CUDA call) for a CUDA device, else
    `fn` itself."""
    compiled: Callable | None = None

    def pick(device: torch.device) -> Callable:
        nonlocal compiled
        if device.type != "cuda":
            return fn
        if compiled is None:
            compiled = torch.compile(fn, **options)
        return compiled

    return pick
