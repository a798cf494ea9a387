"""`dskit init`, `dskit schema` and `dskit catalog`: the starter spec, its JSON Schema, the catalogs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dskit.cli.args import Subparsers
from dskit.errors import SpecError
from dskit.io.text import command, escape


def cmd_init(a: argparse.Namespace) -> int:
    import os
    import stat

    from dskit.io.atomic import write_file
    from dskit.spec import starter_yaml

    if a.output == "-":  # the usual convention: to stdout, e.g. to pipe or diff
        print(starter_yaml(), end="")
        return 0
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
    try:  # a failed write never truncates the old file
        write_file(out, starter_yaml())
    except OSError as e:
        raise SpecError("--output", f"cannot write {out}: {e.strerror or e}") from None
    print(f"wrote {escape(str(out))}: edit it, then `{command(['dskit', 'plan', out])}`")
    return 0


def add_init(sub: Subparsers) -> None:
    s = sub.add_parser("init", help="write a commented starter run spec")
    s.add_argument(
        "-o", "--output", default="dskit.yaml", help="file to write (default: dskit.yaml); - for stdout"
    )
    s.add_argument("--force", action="store_true", help="replace an existing file")
    s.set_defaults(func=cmd_init)


def cmd_schema(a: argparse.Namespace) -> int:
    from dskit.spec import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def add_schema(sub: Subparsers) -> None:
    s = sub.add_parser("schema", help="print the run spec's JSON Schema")
    s.set_defaults(func=cmd_schema)


def cmd_catalog(a: argparse.Namespace) -> int:
    from dskit import catalog

    table = {"gpus": catalog.gpus, "models": catalog.models, "fabrics": catalog.fabrics}[a.kind]()
    for name, entry in table.items():
        print(f"{name:24s} {entry.source}")
    return 0


def add_catalog(sub: Subparsers) -> None:
    s = sub.add_parser("catalog", help="list catalog entries with their sources")
    s.add_argument("kind", choices=("gpus", "models", "fabrics"))
    s.set_defaults(func=cmd_catalog)
