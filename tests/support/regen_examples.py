"""Rewrite the rendered examples from the current code: slurm/ and examples/ (the golden files of the
render tests), images/ (a Dockerfile per catalog GPU), helm/dskit/values.schema.json (from the values
model) and helm/dskit/files/launch.sh (from templates/helm/launch.sh.j2). Run by hand only:
`make examples`; then review the diff."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.golden_cases import (
    CASES,
    GOLDEN,
    TARGET_CASES,
    TARGET_GOLDEN,
    render_case,
    render_target_case,
)

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
VALUES_SCHEMA = REPO / "helm" / "dskit" / "values.schema.json"


def write_tree(root: Path, files: dict[str, str]) -> None:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for rel, text in files.items():
        (root / rel).write_text(text)
        if rel.endswith(".sh") or rel.endswith(".sbatch"):
            (root / rel).chmod(0o755)


def main() -> None:
    from dskit.render import helm, image
    from dskit.render.helm_values import values_schema_json

    for name in CASES:
        write_tree(GOLDEN / name, render_case(name))
    for target, cases in TARGET_CASES.items():
        shutil.rmtree(TARGET_GOLDEN / target, ignore_errors=True)
        for name in cases:
            write_tree(TARGET_GOLDEN / target / name, render_target_case(target, name))
    for name, files in image.catalog_images().items():
        write_tree(IMAGES / name, files)
    VALUES_SCHEMA.write_text(values_schema_json())
    (helm.chart_dir() / helm.LAUNCH_SCRIPT).write_text(helm.launch_script())
    print(f"wrote {GOLDEN} ({len(CASES)} jobs), {TARGET_GOLDEN}, {IMAGES} and {VALUES_SCHEMA}")


if __name__ == "__main__":
    main()
