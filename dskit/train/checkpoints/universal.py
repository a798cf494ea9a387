"""DeepSpeed's checkpoint converter, as dskit runs it: the one command `dskit export` (to read the fp32
weights) and a resharded resume (to load under another layout, reshard.py) both use.

`deepspeed.checkpoint.ds_to_universal` rewrites a ZeRO checkpoint as one directory per parameter
(`zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`), AutoEP's experts consolidated across EP ranks.
It runs in a child process on the CPU accelerator (a trainer's GPU stays the trainer's) with one worker
per phase: each worker holds one rank's optimizer file, which at DeepSeek-V3 scale is tens of GB, on a
host that is also running the job's ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def command(src: Path, out: Path) -> list[str]:
    """The converter's command line: checkpoint tag `src` into directory `out` (which it creates, and
    beside which it writes `latest_universal`)."""
    return [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(src),
        "--output_folder",
        str(out),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]


def environment() -> dict[str, str]:
    """The converter's environment: this one, on the CPU accelerator and seeing no GPU."""
    return {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
