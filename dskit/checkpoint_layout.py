"""The checkpoint directory's names, without torch: the trainer (dskit/train/checkpoint.py) writes
them, and `dskit status` reads them on a login node where torch may not be installed.

    step00000200/   one checkpoint; its DONE file (dskit.json) is written last, so its presence
                    means the checkpoint is complete
"""

from __future__ import annotations

import re
from pathlib import Path

TAG_RE = re.compile(r"^step(\d{8})$")
DONE = "dskit.json"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def complete_tags(root: Path) -> list[str]:
    """Tags under `root` with a completion marker, newest first."""
    if not root.is_dir():
        return []
    return sorted(
        (p.name for p in root.iterdir() if TAG_RE.match(p.name) and (p / DONE).is_file()), reverse=True
    )
