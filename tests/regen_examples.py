"""Rewrite the rendered examples from the current code: slurm/ (the golden files of the render tests)
and images/ (a Dockerfile per catalog GPU). Run by hand only: `make examples`; then review the diff."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.golden_cases import CASES, GOLDEN, render_case

IMAGES = Path(__file__).resolve().parent.parent / "images"


def write_tree(root: Path, files: dict[str, str]) -> None:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for rel, text in files.items():
        (root / rel).write_text(text)
        if rel.endswith(".sh") or rel.endswith(".sbatch"):
            (root / rel).chmod(0o755)


def main() -> None:
    from dskit.render import image

    for name in CASES:
        write_tree(GOLDEN / name, render_case(name))
    for name, files in image.catalog_images().items():
        write_tree(IMAGES / name, files)
    print(f"wrote {GOLDEN} ({len(CASES)} jobs) and {IMAGES}")


if __name__ == "__main__":
    main()
