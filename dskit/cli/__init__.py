"""`dskit` command line. Small and stable: new knobs go into the spec (and `--set`), not new flags.

Each command's module holds its `cmd_*` and the `add_*` that declares its flags beside it; COMMANDS
is the order `dskit --help` lists them in.
"""

from __future__ import annotations

import argparse
import sys

from dskit.cli import calibrate_cmd, data_cmd, host_cmd, plan_cmd, run_cmd, spec_cmd
from dskit.cli.args import Parser, refuse_empty_values
from dskit.errors import EXIT_BAD_INPUT, SpecError
from dskit.io import stdout
from dskit.io.text import escape

COMMANDS = (
    spec_cmd.add_init,
    spec_cmd.add_schema,
    plan_cmd.add_plan,
    plan_cmd.add_render,
    calibrate_cmd.add_calibrate,
    spec_cmd.add_catalog,
    run_cmd.add_train,
    run_cmd.add_export,
    host_cmd.add_doctor,
    host_cmd.add_build,
    run_cmd.add_status,
    run_cmd.add_report,
    data_cmd.add_data,
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dskit",
        description="Train DeepSeek-style MoE models (AutoEP + DeepSpeed ZeRO) from one run spec: plan it, render it "
        "for Slurm, Kubernetes (Helm) or Ray, and run the in-container trainer.",
        epilog="Bad input exits with code 2 and one line naming the field; a failed write to stdout with 74 "
        "and one line (a full disk), or quietly with 141 (a closed pipe: `| head`). Docs: README.md.",
    )
    from dskit import __version__

    p.add_argument("--version", action="version", version=f"dskit {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    refuse_empty_values(p)
    return p


def main(argv: list[str] | None = None) -> int:
    # every command's output (--help included) goes through one guard: a full disk or a closed pipe
    # behind stdout is one line or a quiet exit (dskit/io/stdout.py), never a traceback
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
