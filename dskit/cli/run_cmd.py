"""`dskit train`, `export`, `status` and `report`: what runs from, or reads, a rendered run directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from dskit.cli.args import Subparsers, count
from dskit.errors import SpecError
from dskit.host.extras import require


def cmd_train(a: argparse.Namespace) -> int:
    require("train", "train")
    from dskit.train.local import run_local

    if not a.local:
        # Inside a launcher (torchrun / Ray) the entry point is `python -m dskit.train`.
        from dskit.train.entry import main as train_main

        return train_main()
    return run_local(a.run, nproc=a.nproc)


def add_train(sub: Subparsers) -> None:
    s = sub.add_parser(
        "train",
        help="run the trainer (inside a launcher, or --local on this machine)",
        description="Without --local this is `python -m dskit.train` (reads DSKIT_RUN_FILE). "
        "With --local it starts torchrun on this machine for a rendered run directory.",
    )
    s.add_argument("run", nargs="?", help="run directory or run.yaml (with --local)")
    s.add_argument("--local", action="store_true", help="launch torchrun here (CPU demo, debugging)")
    s.add_argument("--nproc", type=count, default=None, help="processes (default: the plan's per-node count)")
    s.set_defaults(func=cmd_train)


def cmd_export(a: argparse.Namespace) -> int:
    from dskit.io.atomic import check_replaceable
    from dskit.launch.contract import RUN_YAML
    from dskit.plan.schema import load_plan

    require("export", "train")
    run_yaml = Path(a.run) / RUN_YAML if Path(a.run).is_dir() else Path(a.run)
    # export reads the run dir, its run.yaml and the checkpoints: -o --force must not replace them
    inputs: list[str | Path] = [run_yaml]
    if run_yaml.is_file():
        inputs.append(load_plan(run_yaml).run.checkpoint_dir)
    check_replaceable(a.output, force=a.force, kind="export", inputs=inputs)
    if a.shard_mib < 1:
        raise SpecError("--shard-mib", f"must be a positive number of MiB, got {a.shard_mib}")
    from dskit.train.export import export

    export(
        a.run,
        a.output,
        force=a.force,
        verify=not a.no_verify,
        shard_bytes=a.shard_mib * 2**20,
        adapter_only=a.adapter_only,
        fp8=a.fp8,
    )
    return 0


def add_export(sub: Subparsers) -> None:
    s = sub.add_parser(
        "export", help="write a Hugging Face model (config.json + safetensors) from a checkpoint"
    )
    s.add_argument("run", help="run directory (with run.yaml) or run.yaml")
    s.add_argument("-o", "--output", required=True, help="directory for the Hugging Face model")
    s.add_argument("--force", action="store_true", help="replace an existing output directory")
    s.add_argument("--no-verify", action="store_true", help="skip the logits check against the trained model")
    s.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA runs: write the adapter in peft's format (adapter_config.json + adapter_model.safetensors) "
        "instead of the merged model",
    )
    s.add_argument(
        "--fp8",
        action="store_true",
        help="write the weights in DeepSeek-V3's published FP8 format, as serving engines load V3: every "
        "projection and routed expert e4m3 with a float32 scale per 128 x 128 block (quantized from the "
        "trained float32 weights), the experts one tensor each, the embedding, norms, router and head in the "
        "run's precision; checked by reading it back with transformers (docs/trainer.md)",
    )
    s.add_argument(
        "--shard-mib",
        type=count,
        default=5120,
        help="largest safetensors file in MiB (default 5120, transformers' 5 GiB); export streams shard by "
        "shard, so its memory is one shard plus one tensor, whatever the model's size",
    )
    s.set_defaults(func=cmd_export)


def cmd_status(a: argparse.Namespace) -> int:
    from dskit.render import TARGETS
    from dskit.status import run_status

    if run_status.is_run_dir(a.what):
        return run_status.status(
            a.what,
            TARGETS,
            address=a.address,
            namespace=a.namespace,
            kubeconfig=a.kubeconfig,
            context=a.context,
        )
    if Path(a.what).is_dir() or "/" in a.what:
        raise SpecError(
            "RUN_DIR",
            f"{a.what} is not a run directory (no run.yaml in it); give one `dskit render` wrote, "
            "or a Helm release name",
        )
    if a.address:
        raise SpecError("--address", "is for a Ray run directory, not a Helm release")
    from dskit.status.k8s import status

    return status(a.what, a.namespace, kubeconfig=a.kubeconfig, context=a.context)


def add_status(sub: Subparsers) -> None:
    s = sub.add_parser(
        "status",
        help="where a run stands: scheduler state, attempts, step/total, loss, tokens/s, ETA, last checkpoint",
        description="RUN_DIR (a directory with run.yaml): asks the scheduler it was rendered for about the "
        "jobs submitted from it, recorded in RUN_DIR/jobs by its submit.sh (Slurm: scontrol, or sacct once "
        "slurmctld has forgotten a job; requeues from Restarts=. Ray: the job client, at the address "
        "submit.sh used or --address. Helm: the pods of release NAME, the run's name), and reads step, loss, "
        "tokens/s, ETA and the last checkpoint from the run's metrics.jsonl and checkpoint dir. "
        "RELEASE (anything else): the pods of a Helm release by rank index, attempts, phase, exit codes "
        "(Kubernetes needs the k8s extra: pip install 'dskit[k8s]'; Ray the ray extra).",
    )
    s.add_argument("what", metavar="RUN_DIR|RELEASE", help="a rendered run directory, or a Helm release name")
    s.add_argument("--address", help="Ray: the dashboard address (default: the one submit.sh recorded)")
    s.add_argument("-n", "--namespace", default="default", help="Kubernetes namespace (default: default)")
    s.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    s.add_argument("--context", help="kubeconfig context")
    s.set_defaults(func=cmd_status)


def cmd_report(a: argparse.Namespace) -> int:
    require("report", "report")
    from dskit.status.report import report

    files = report(a.run, a.output)
    print(f"wrote {len(files)} files to {files[-1].parent}: open {files[-1]}")
    return 0


def add_report(sub: Subparsers) -> None:
    s = sub.add_parser(
        "report",
        help="plots (PNG) and one self-contained HTML page from a run's metrics",
        description="Reads run.yaml, OUTPUT_DIR/metrics.jsonl and launch-env.json; works on a finished, "
        "running or resumed run (needs the report extra: pip install 'dskit[report]').",
    )
    s.add_argument("run", help="run directory (with run.yaml), or a directory holding metrics.jsonl")
    s.add_argument("-o", "--output", help="directory for the PNGs and index.html (default: RUN/report)")
    s.set_defaults(func=cmd_report)
