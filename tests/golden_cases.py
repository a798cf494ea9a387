"""Golden render cases: name -> (spec overrides, CLI-style flags). Shared by the test and the regenerator.

Regenerate after an intended change:  make examples   (python -m tests.regen_examples; review the diff)
"""

from __future__ import annotations

from pathlib import Path

# The rendered examples users read in slurm/ are the golden files: one copy, checked by the tests.
GOLDEN = Path(__file__).resolve().parent.parent / "slurm"

CASES: dict[str, tuple[list[str], dict[str, object]]] = {
    # the README's headline command: dskit render slurm --nodes 2
    "v2-lite-h100-2node-pyxis": ([], {"hardware.nodes": 2}),
    "tiny-v2-cpu-venv": (
        ["training.seq_len=128", "training.global_batch=8", "storage.root=/scratch/dskit"],
        {
            "hardware.gpu": "cpu",
            "hardware.gpus_per_node": 2,
            "model.preset": "tiny-v2",
            "runtime.kind": "none",
            "runtime.python": "/opt/venv/bin/python",
        },
    ),
    "v3-h100-16node-apptainer-efa": (
        [
            "slurm.partition=gpu",
            "slurm.account=ml",
            "slurm.extra_args=[--mail-type=END]",
            "network.interface=ens5",
        ],
        {
            "model.preset": "deepseek-v3",
            "hardware.nodes": 16,
            "network.fabric": "efa",
            "runtime.kind": "apptainer",
            "runtime.image": "/images/dskit-h100.sif",
        },
    ),
    "v2-lite-v100-4node-roce-fp16": (
        ["training.seq_len=2048"],
        {
            "hardware.gpu": "v100-32gb",
            "network.fabric": "roce",
            "hardware.nodes": 4,
            "model.preset": "deepseek-v2-lite",
        },
    ),
}


def render_case(name: str) -> dict[str, str]:
    from dskit.plan import build_plan
    from dskit.render import slurm
    from dskit.spec import load_spec

    sets, flags = CASES[name]
    plan = build_plan(load_spec(sets=sets, flags=flags))
    return slurm.render(plan, Path(f"/runs/{name}"))
