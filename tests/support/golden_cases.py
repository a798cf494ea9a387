"""Golden render cases: name -> (spec overrides, CLI-style flags). Shared by the tests and the regenerator.
Slurm cases live in slurm/ (the examples users read); Helm values and the Ray job in examples/TARGET/.

Regenerate after an intended change:  make examples   (python -m tests.support.regen_examples; review the diff)
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The rendered examples users read in slurm/ are the golden files: one copy, checked by the tests.
GOLDEN = REPO / "slurm"
TARGET_GOLDEN = REPO / "examples"

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
    from dskit.plan.build import build_plan
    from dskit.render import slurm
    from dskit.spec import load_spec

    sets, flags = CASES[name]
    plan = build_plan(load_spec(sets=sets, flags=flags))
    return slurm.render(plan, Path(f"/runs/{name}"))


# Other targets: target -> case -> (sets, flags), and the files of each render kept as goldens (the chart
# copy is the chart itself; run.yaml and deepspeed.json are covered by the Slurm cases and embedded here).
TARGET_CASES: dict[str, dict[str, tuple[list[str], dict[str, object]]]] = {
    "helm": {
        "v2-lite-h100-2node": ([], {"hardware.nodes": 2, "hardware.gpu": "h100-80gb"}),
        "tiny-v2-cpu": (
            ["training.seq_len=128", "training.global_batch=8", "kubernetes.cpu=4", "kubernetes.memory=16Gi"],
            {"hardware.gpu": "cpu", "hardware.gpus_per_node": 2, "model.preset": "tiny-v2"},
        ),
        # docs/targets.md's worked examples: a JobSet through Kueue (examples/kueue/queues.yaml's
        # LocalQueue, priority class and topology level), and a TrainJob
        "v3-h200-jobset-kueue": (
            [
                "name=dsv3",
                "kubernetes.workload=jobset",
                "kubernetes.queue=training",
                "kubernetes.queue_priority=research",
                "kubernetes.topology=preferred",
                "kubernetes.existing_claim=team-checkpoints",
            ],
            {
                "model.preset": "deepseek-v3",
                "hardware.gpu": "h200-141gb",
                "hardware.nodes": 32,
                "network.fabric": "infiniband",
            },
        ),
        "v2-lite-h100-trainjob": (
            ["name=v2lite", "kubernetes.workload=trainjob", "kubernetes.queue=training"],
            {"hardware.nodes": 2, "hardware.gpu": "h100-80gb"},
        ),
    },
    "ray": {
        "tiny-v2-cpu": (
            ["training.seq_len=128", "training.global_batch=8", "runtime.python=/opt/venv/bin/python"],
            {"hardware.gpu": "cpu", "hardware.gpus_per_node": 2, "model.preset": "tiny-v2"},
        ),
        "v2-lite-h100-2node-existing-claim": (
            ["kubernetes.existing_claim=team-checkpoints"],
            {"hardware.nodes": 2, "hardware.gpu": "h100-80gb"},
        ),
    },
}
TARGET_FILES = {"helm": ("values.yaml",), "ray": ("rayjob.yaml", "runtime_env.yaml", "submit.sh")}


def render_target_case(target: str, name: str) -> dict[str, str]:
    from dskit.plan.build import build_plan
    from dskit.render import TARGETS
    from dskit.spec import load_spec

    sets, flags = TARGET_CASES[target][name]
    files = TARGETS[target].render(build_plan(load_spec(sets=sets, flags=flags)), Path(f"/runs/{name}"))
    return {rel: files[rel] for rel in TARGET_FILES[target]}
