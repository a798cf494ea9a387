"""`dskit` command line. Small and stable: new knobs go into the spec (and `--set`), not new flags."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from dskit import stdout
from dskit.errors import EXIT_BAD_INPUT, SpecError
from dskit.text import escape


def count(text: str) -> int:
    """An integer flag: ASCII digits only (int() would also take '١', '+1', ' 2' or '1_0')."""
    if not re.fullmatch(r"[0-9]{1,18}", text):
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (ASCII digits 0-9 only)")
    return int(text)


def _fraction(text: str) -> float:
    """A share in [0, 1) written as a plain decimal (no 'nan', 'inf', '1e-2' surprises: 0.01)."""
    if not re.fullmatch(r"0?\.[0-9]{1,12}|0", text):
        raise argparse.ArgumentTypeError(
            f"invalid fraction: {text!r} (a decimal from 0 to below 1, e.g. 0.01)"
        )
    return float(text)


# Flags that map 1:1 onto spec fields (dest -> dotted spec key).
SPEC_FLAGS: dict[str, tuple[str, Any, str]] = {
    "job_name": ("name", str, "run/job name (spec: name)"),
    "model": ("model.preset", str, "catalog model (spec: model.preset)"),
    "gpu": ("hardware.gpu", str, "GPU profile (spec: hardware.gpu)"),
    "gpus_per_node": ("hardware.gpus_per_node", count, "GPUs per node (spec: hardware.gpus_per_node)"),
    "nodes": ("hardware.nodes", count, "node count (spec: hardware.nodes)"),
    "fabric": ("network.fabric", str, "network fabric (spec: network.fabric)"),
    "runtime": ("runtime.kind", str, "Slurm: pyxis | apptainer | none (spec: runtime.kind)"),
    "image": ("runtime.image", str, "container image (spec: runtime.image)"),
    "chain": ("slurm.chain", count, "Slurm: a chain of N jobs for long runs (spec: slurm.chain)"),
}


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="run spec YAML (default: built-in defaults; see `dskit init`)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any spec field, e.g. --set training.steps=100 --set slurm.time=48:00:00 "
        "(repeatable). VALUE is taken literally (no YAML: '#' and quotes are characters) unless it is "
        "a number, true/false, null, a [a, b] list or a {k: v} mapping",
    )
    for dest, (_, typ, help_) in SPEC_FLAGS.items():
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, type=typ, help=help_)


def _spec_from_args(a: argparse.Namespace):
    from dskit.spec import load_spec

    flags = {key: getattr(a, dest) for dest, (key, _, _) in SPEC_FLAGS.items()}
    return load_spec(a.spec, a.set, flags)


def cmd_init(a: argparse.Namespace) -> int:
    import os
    import stat
    import tempfile

    from dskit.spec import starter_yaml

    if not a.output:
        raise SpecError("--output", "is empty; give a file name")
    out = Path(a.output)
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise SpecError("--output", f"cannot use {out}: {e.strerror or e}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
            raise SpecError("--output", f"{out} is a directory or a link; give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(
                "--output", f"{out} is not a regular file (FIFO, socket or device); give a file name"
            )
        if not a.force:
            raise SpecError("--output", f"{out} already exists; pass --force to replace it")
    # a temporary file beside it, renamed into place: a failed write never truncates the old file
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".dskit-init-", suffix=".tmp", dir=out.parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(fd, 0o666 & ~umask)  # what a plain open() would have made
        with os.fdopen(fd, "w") as f:
            f.write(starter_yaml())
        os.replace(tmp, out)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise SpecError("--output", f"cannot write {out}: {e.strerror or e}") from None
    print(f"wrote {out}: edit it, then `dskit plan {out}`")
    return 0


def cmd_schema(a: argparse.Namespace) -> int:
    from dskit.spec import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    from dskit.plan.build import build_plan_searched
    from dskit.plan.schema import dump_plan

    if a.plot:
        target = Path(a.plot)
        if target.suffix.lower() != ".png":
            raise SpecError("--plot", f"{a.plot}: give a .png file name")
        if target.is_dir():
            raise SpecError("--plot", f"{a.plot} is a directory; give a file name")
        parent = target.resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise SpecError("--plot", f"{parent} is not a writable directory")
        try:
            import matplotlib  # noqa: F401  (checked first: the one-line error names the extra)
        except ModuleNotFoundError as e:
            raise _needs_extra("plan --plot", "report", e) from None
    plan, found = build_plan_searched(_spec_from_args(a))
    if a.plot:  # first: a plot that cannot be written fails before anything is printed
        from dskit.explain import plot

        try:
            written = plot(plan, found, Path(a.plot))
        except OSError as e:
            raise SpecError("--plot", f"cannot write {a.plot}: {e.strerror or e}") from None
        print(f"wrote {written}", file=sys.stderr)
    if a.explain:
        from dskit.explain import row_dict, table

        if a.json:
            print(
                json.dumps(
                    {"plan": plan.model_dump(mode="json"), "candidates": [row_dict(r) for r in found.rows]},
                    indent=2,
                )
            )
        else:
            print(table(plan, found))
            for w in plan.warnings:
                print(f"warning: {w}", file=sys.stderr)
    elif a.json:
        print(json.dumps(plan.model_dump(mode="json"), indent=2))
    else:
        print(dump_plan(plan), end="")
        _print_summary(plan)
    return 0


def _print_summary(plan: Any, out_dir: Path | None = None) -> None:
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if out_dir:
        print(f"wrote {out_dir}")
    print(plan.summary())


def cmd_render(a: argparse.Namespace) -> int:
    from dskit.atomic import check_replaceable
    from dskit.plan.build import build_plan
    from dskit.render import TARGETS, common

    target = TARGETS[a.target]
    spec = _spec_from_args(a)
    plan = build_plan(spec)
    # what the render reads: --force must never replace a directory holding one of them
    sources = [x.path for x in spec.data.sources or []]
    inputs = [a.spec, spec.data.path, spec.data.eval_path, *sources, spec.model.path]
    default = f"runs/{plan.name}-{a.target}"
    out = check_replaceable(
        default if a.output is None else a.output, force=a.force, kind="run", inputs=inputs
    )
    for kept in [plan.run.checkpoint_dir, plan.run.output_dir, *target.writes(plan)]:
        if Path(kept).resolve().is_relative_to(out):
            # replacing the run dir (--force) would delete the checkpoints and metrics inside it
            raise SpecError("--output", f"{out} would contain {kept}; render elsewhere or move storage.root")
    files = target.files(plan, out)
    common.write_output(files, out, force=a.force, executable=target.executable, inputs=inputs)
    _print_summary(plan, out)
    print(f"next: {target.next_step(plan, out, files)}")
    return 0


def cmd_catalog(a: argparse.Namespace) -> int:
    from dskit import catalog

    table = {"gpus": catalog.gpus, "models": catalog.models, "fabrics": catalog.fabrics}[a.kind]()
    for name, entry in table.items():
        print(f"{name:24s} {entry.source}")
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from dskit.train.local import run_local

    if not a.local:
        # Inside a launcher (torchrun / Ray) the entry point is `python -m dskit.train`.
        from dskit.train.entry import main as train_main

        return train_main()
    return run_local(a.run, nproc=a.nproc)


def cmd_doctor(a: argparse.Namespace) -> int:
    from dskit.doctor import main as doctor_main

    return doctor_main(as_json=a.json, build=a.build)


def cmd_build(a: argparse.Namespace) -> int:
    from dskit.build import build_image

    return build_image(
        a.gpu,
        a.fabric,
        tag=a.tag,
        engine=a.engine,
        build_args=a.build_arg,
        engine_args=a.engine_arg,
    )


def cmd_status(a: argparse.Namespace) -> int:
    from dskit import run_status

    if run_status.is_run_dir(a.what):
        return run_status.status(
            a.what, address=a.address, namespace=a.namespace, kubeconfig=a.kubeconfig, context=a.context
        )
    if Path(a.what).is_dir() or "/" in a.what:
        raise SpecError(
            "RUN_DIR",
            f"{a.what} is not a run directory (no run.yaml in it); give one `dskit render` wrote, "
            "or a Helm release name",
        )
    if a.address:
        raise SpecError("--address", "is for a Ray run directory, not a Helm release")
    from dskit.k8s_status import status

    return status(a.what, a.namespace, kubeconfig=a.kubeconfig, context=a.context)


def _needs_extra(command: str, extra: str, e: ModuleNotFoundError) -> SpecError:
    return SpecError(command, f"needs the {extra} extra (missing {e.name}): pip install 'dskit[{extra}]'")


def cmd_export(a: argparse.Namespace) -> int:
    from dskit.atomic import check_replaceable
    from dskit.contract import RUN_YAML
    from dskit.plan.schema import load_plan

    run_yaml = Path(a.run) / RUN_YAML if Path(a.run).is_dir() else Path(a.run)
    # export reads the run dir, its run.yaml and the checkpoints: -o --force must not replace them
    inputs: list[str | Path] = [run_yaml]
    if run_yaml.is_file():
        inputs.append(load_plan(run_yaml).run.checkpoint_dir)
    check_replaceable(a.output, force=a.force, kind="export", inputs=inputs)
    if a.shard_mib < 1:
        raise SpecError("--shard-mib", f"must be a positive number of MiB, got {a.shard_mib}")
    try:
        from dskit.train.export import export

        export(a.run, a.output, force=a.force, verify=not a.no_verify, shard_bytes=a.shard_mib * 2**20)
    except ModuleNotFoundError as e:
        raise _needs_extra("export", "train", e) from None
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401  (checked first: the one-line error names the extra)
    except ModuleNotFoundError as e:
        raise _needs_extra("report", "report", e) from None
    from dskit.report import report

    files = report(a.run, a.output)
    print(f"wrote {len(files)} files to {files[-1].parent}: open {files[-1]}")
    return 0


def cmd_data(a: argparse.Namespace) -> int:
    from dskit.atomic import check_replaceable

    tokenizer_dir = None if a.tokenizer == "byte" else a.tokenizer
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not 1 <= a.workers <= cpus:
        raise SpecError("--workers", f"{a.workers}: give 1 to {cpus} (this machine's CPUs)")
    check_replaceable(a.output, force=a.force, kind="data", inputs=[*a.inputs, tokenizer_dir])
    try:
        from dskit.data.prepare import prepare

        prepare(
            a.inputs,
            a.output,
            tokenizer=a.tokenizer,
            force=a.force,
            eval_fraction=a.eval_fraction,
            text_field=a.text_field,
            workers=a.workers,
        )
    except ModuleNotFoundError as e:  # numpy/tqdm, transformers for a tokenizer dir; pyarrow, zstandard
        extra = "data" if e.name in ("pyarrow", "zstandard") else "train"
        raise _needs_extra("data prepare", extra, e) from None
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with the one-line promise: a bad flag or value is `dskit: error: ...`, exit 2, without
    the usage block (`--help` still shows it). Sub-commands inherit this class."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"dskit: error: {escape(self.prog)}: {escape(message)} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="dskit",
        description="Train DeepSeek-style MoE models (AutoEP + DeepSpeed ZeRO) from one run spec: plan it, render it "
        "for Slurm, Kubernetes (Helm) or Ray, and run the in-container trainer.",
        epilog="Bad input exits with code 2 and one line naming the field; a failed write to stdout with 74 "
        "and one line (a full disk), or quietly with 141 (a closed pipe: `| head`). Docs: README.md.",
    )
    from dskit import __version__

    p.add_argument("--version", action="version", version=f"dskit {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("init", help="write a commented starter run spec")
    s.add_argument("-o", "--output", default="dskit.yaml", help="file to write (default: dskit.yaml)")
    s.add_argument("--force", action="store_true", help="replace an existing file")
    s.set_defaults(func=cmd_init)

    s = sub.add_parser("schema", help="print the run spec's JSON Schema")
    s.set_defaults(func=cmd_schema)

    s = sub.add_parser(
        "plan",
        help="resolve a spec into the plan (run.yaml) and print it",
        description="Resolve the spec into the plan. The planner weighs every EP size, micro-batch x "
        "gradient accumulation, activation checkpointing (off, every 2nd layer, every layer) and optimizer offload (off, "
        "cpu): each is checked against GPU and host memory and timed by the step-time model "
        "(dskit/plan/speed.py); the fastest that fits wins. --explain shows them all.",
    )
    _add_spec_args(s)
    s.add_argument(
        "--json", action="store_true", help="print JSON instead of YAML (with --explain: plan + candidates)"
    )
    s.add_argument(
        "--explain",
        action="store_true",
        help="print every candidate: memory breakdown, predicted step time, tokens/s/GPU, MFU, why it lost",
    )
    s.add_argument("--plot", metavar="FILE.png", help="draw the candidates' memory and predicted throughput")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser(
        "render",
        help="write a run directory for a target",
        description="Resolve the spec and write run.yaml, deepspeed.json and the target's files "
        "into a new directory (atomically: all files or none).",
    )
    from dskit.render import TARGETS

    s.add_argument(
        "target",
        choices=list(TARGETS),
        help="; ".join(f"{t.name}: {t.help}" for t in TARGETS.values()),
    )
    _add_spec_args(s)
    s.add_argument("-o", "--output", help="run directory to create (default: runs/NAME-TARGET)")
    s.add_argument("--force", action="store_true", help="replace an existing run directory")
    s.set_defaults(func=cmd_render)

    s = sub.add_parser("catalog", help="list catalog entries with their sources")
    s.add_argument("kind", choices=("gpus", "models", "fabrics"))
    s.set_defaults(func=cmd_catalog)

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

    s = sub.add_parser(
        "export", help="write a Hugging Face model (config.json + safetensors) from a checkpoint"
    )
    s.add_argument("run", help="run directory (with run.yaml) or run.yaml")
    s.add_argument("-o", "--output", required=True, help="directory for the Hugging Face model")
    s.add_argument("--force", action="store_true", help="replace an existing output directory")
    s.add_argument("--no-verify", action="store_true", help="skip the logits check against the trained model")
    s.add_argument(
        "--shard-mib",
        type=count,
        default=5120,
        help="largest safetensors file in MiB (default 5120, transformers' 5 GiB); export streams shard by "
        "shard, so its memory is one shard plus one tensor, whatever the model's size",
    )
    s.set_defaults(func=cmd_export)

    s = sub.add_parser(
        "doctor",
        help="check this host/container: GPU vs image arch, flash-attn, DeepSpeed ops, NCCL, /dev/shm, RDMA",
        description="One PASS/WARN/FAIL line per check; exit code 1 if anything fails.",
    )
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--build", action="store_true", help="image build smoke test: no GPU or launcher expected")
    s.set_defaults(func=cmd_doctor)

    s = sub.add_parser(
        "build",
        help="build a GPU profile's image with the container engine here (podman, buildah, docker)",
        description="Renders the image for --gpu (as `dskit render image`), builds it from this checkout "
        "and prints the tag, size and build time. Base images and torch's index are build arguments: "
        "--build-arg BUILDER_IMAGE=... --build-arg RUNTIME_IMAGE=... --build-arg DSKIT_TORCH_INDEX=...",
    )
    s.add_argument("what", choices=("image",), help="what to build")
    s.add_argument("--gpu", required=True, help="GPU profile (dskit catalog gpus; cpu for the CPU image)")
    s.add_argument("--fabric", default="infiniband", help="network fabric (efa adds AWS's libraries)")
    s.add_argument(
        "--tag", help="image tag (default: the rendered one, e.g. dskit:cpu-torch2.13.0-cpu-ds0.19.8)"
    )
    s.add_argument(
        "--engine", default="auto", help="podman | buildah | docker (default: the first of them found)"
    )
    s.add_argument(
        "--build-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="passed to the engine (repeatable)",
    )
    s.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra engine flag, e.g. --engine-arg=--network=host (repeatable)",
    )
    s.set_defaults(func=cmd_build)

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

    s = sub.add_parser(
        "report",
        help="plots (PNG) and one self-contained HTML page from a run's metrics",
        description="Reads run.yaml, OUTPUT_DIR/metrics.jsonl and launch-env.json; works on a finished, "
        "running or resumed run (needs the report extra: pip install 'dskit[report]').",
    )
    s.add_argument("run", help="run directory (with run.yaml), or a directory holding metrics.jsonl")
    s.add_argument("-o", "--output", help="directory for the PNGs and index.html (default: RUN/report)")
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("data", help="data tools: prepare token shards from text, JSONL, Parquet, Arrow, chat")
    dsub = s.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    d = dsub.add_parser(
        "prepare",
        help="tokenize text, JSONL, Parquet or Arrow (plain or chat records) into token shards",
        description="Tokenize the inputs into a shard directory for data.path (or one of data.sources). "
        "Records with 'messages' are chat: rendered with the tokenizer's chat template, loss only on the "
        "assistant turns. The output is written beside the destination and swapped in whole.",
    )
    d.add_argument(
        "inputs",
        nargs="+",
        help=".txt/.text/.md (one document each), .jsonl (those also .gz/.zst), .parquet, .arrow files or a "
        "local datasets save_to_disk dir; records with 'messages' are chat, others use the text field",
    )
    d.add_argument(
        "--text-field",
        default="text",
        help="the text field/column of JSONL, Parquet and Arrow records (default: text)",
    )
    d.add_argument("-o", "--output", required=True, help="shard directory to create")
    d.add_argument(
        "--tokenizer", default="byte", help="'byte' (built in) or a local Hugging Face tokenizer dir"
    )
    d.add_argument(
        "--eval-fraction",
        type=_fraction,
        default=0.0,
        help="hold out about this share of the documents (0 to <1) in DIR/eval for the eval loss",
    )
    d.add_argument(
        "--workers",
        type=count,
        default=1,
        help="tokenizer processes, at most this machine's CPUs (default 1); the shards are byte-identical "
        "for any number",
    )
    d.add_argument(
        "--force", action="store_true", help="replace an existing directory of prepared data (only that)"
    )
    d.set_defaults(func=cmd_data)
    return p


def main(argv: list[str] | None = None) -> int:
    # every command's output (--help included) goes through one guard: a full disk or a closed pipe
    # behind stdout is one line or a quiet exit (dskit/stdout.py), never a traceback
    return stdout.guarded(lambda: _run(argv))


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return a.func(a)
    except SpecError as e:
        print(f"dskit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        # a path the user gave that the OS refuses (ENAMETOOLONG, EACCES, ELOOP...), or a deleted
        # current directory under a relative path: one line naming it, not a traceback
        where = e.filename if e.filename is not None else _cwd_gone()
        if where is None:
            raise
        print(f"dskit: error: {escape(str(where))}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _cwd_gone() -> str | None:
    """'current directory' when it no longer exists (os.path.abspath then raises FileNotFoundError)."""
    import os

    try:
        os.getcwd()
    except OSError:
        return "current directory (deleted; cd to an existing one)"
    return None


if __name__ == "__main__":
    sys.exit(main())
